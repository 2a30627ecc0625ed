"""A call's inputs as a hashable key (their structure, tensor shapes and dtypes, plain values,
grad and autocast modes) and its tensors, and the call rebuilt from a key with other tensors: how a
CUDA graph's call is recognised and fed (`graphs.py`)."""

from __future__ import annotations

import torch

INPUT_LIMIT = 64 << 20  # tensor bytes a call may take and still be graphed
_SCALARS = (type(None), bool, int, float, str)
Key = tuple


def describe(args: tuple, kwargs: dict) -> tuple[Key, list[torch.Tensor]] | None:
    """(a hashable key of the call: its structure, tensor shapes and dtypes, plain values and the
    grad/autocast modes; its tensors in order), or None when it cannot be graphed: an object
    other than tensors, plain values, tuples, lists and dicts, a tensor off the GPU or needing
    grad, grad enabled, or tensor inputs over the limit."""
    if torch.is_grad_enabled():
        return None
    tensors: list[torch.Tensor] = []
    key = describe_value((args, kwargs), tensors)
    if key is None or sum(t.nbytes for t in tensors) > INPUT_LIMIT:
        return None
    modes = (torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    return (key, modes), tensors


def describe_value(obj: object, tensors: list[torch.Tensor]) -> object | None:
    """``obj``'s key, its tensors appended to ``tensors``; None where an object cannot be described."""
    kind = type(obj)
    if kind is torch.Tensor:
        if obj.device.type != "cuda" or obj.requires_grad:
            return None
        tensors.append(obj)
        return (obj.shape, obj.stride(), obj.dtype, obj.device.index)
    if kind is tuple or kind is list:
        items = tuple(describe_value(o, tensors) for o in obj)
        return None if None in items else (kind, items)
    if kind is dict:
        items = tuple((k, describe_value(v, tensors)) for k, v in obj.items())
        return None if any(d is None for _k, d in items) else (dict, items)
    if kind in _SCALARS:
        return (kind, obj)
    return None


def rebuild(key: object, tensors: list[torch.Tensor]) -> object:
    """The call (or output) ``key`` describes, with ``tensors`` in its tensor places, in order."""
    return _build(key, iter(tensors))


def _build(key: object, it) -> object:
    """(A module function, not a closure over itself: that would be a reference cycle holding
    every replay's output tensors until the garbage collector ran.)"""
    if isinstance(key[0], torch.Size):
        return next(it)
    kind, value = key
    if kind is tuple or kind is list:
        return kind(_build(v, it) for v in value)
    if kind is dict:
        return {name: _build(v, it) for name, v in value}
    return value

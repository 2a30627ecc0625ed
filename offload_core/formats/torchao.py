"""Weights that are tensor subclasses holding their data in inner tensors (torchao's int8
weight-only ``Int8Tensor``: ``qdata``, ``scale``, ``zero_point``): how the engine sizes and moves them.

``param.data = other`` replaces only such a tensor's outer wrapper and leaves the inner tensors
(what the layer computes from) where they were, so a move swaps the whole tensor into the same
Parameter object (``torch.utils.swap_tensors``, what ``nn.Module.to`` does for them too). Their
size is the inner tensors' bytes (``__tensor_flatten__``), not ``numel`` times the outer dtype
(an int8 weight reports float32). Nothing here imports torchao: the engine only reads the
subclass protocol, so it stays an optional dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "alias",
    "inner_tensors",
    "is_wrapper",
    "is_wrapper_module",
    "map_inner",
    "storage_bytes",
    "swap_into",
]


def is_wrapper(t: torch.Tensor) -> bool:
    """True for a tensor subclass whose data lives in inner tensors (torchao, DTensor, ...)."""
    return is_traceable_wrapper_subclass(t)


def is_wrapper_module(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is such a subclass."""
    return any(is_wrapper(t) for t in (*module.parameters(), *module.buffers()))


def inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``t``'s data (``t`` itself when it is plain); nested subclasses
    are flattened down to their plain tensors."""
    if not is_wrapper(t):
        yield t
        return
    names, _ctx = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        if inner is not None:
            yield from inner_tensors(inner)


def storage_bytes(t: torch.Tensor, device: torch.device | None = None) -> int:
    """Bytes ``t`` holds in memory (on ``device`` only, when given): the sum of its inner tensors."""
    return sum(i.numel() * i.element_size() for i in inner_tensors(t) if device is None or i.device == device)


def map_inner(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``t`` rebuilt from ``fn`` of each inner tensor (same metadata); ``t`` itself when ``fn``
    returned every inner tensor unchanged."""
    names, ctx = t.__tensor_flatten__()
    old = {name: getattr(t, name) for name in names}
    new = {name: map_inner(v, fn) if is_wrapper(v) else fn(v) for name, v in old.items()}
    if all(new[name] is old[name] for name in names):
        return t
    return type(t).__tensor_unflatten__(new, ctx, t.size(), t.stride())


def alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object over the same inner tensors as ``t`` (what ``t.data`` is for a plain
    tensor): it keeps the resting data reachable while ``t`` itself is swapped to the device."""
    names, ctx = t.__tensor_flatten__()
    return type(t).__tensor_unflatten__({n: getattr(t, n) for n in names}, ctx, t.size(), t.stride())


def swap_into(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    """Make the Parameter object ``param`` hold ``tensor`` (its outer wrapper and inner tensors):
    modules, hooks and dicts keyed by ``id(param)`` keep seeing the same object."""
    torch.utils.swap_tensors(param, torch.nn.Parameter(tensor, requires_grad=param.requires_grad))

"""Workload of a cycle: the key under which its activation peak is measured.

Activations scale with the tokens a step processes, and the largest input of the first block
(the hidden states) counts them; a resolution or frame count change is thus a new workload,
measured separately. A model whose first block hides its size supplies its own function with
the same signature as its ``offload_workload`` attribute (`workload_fn`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

WorkloadFn = Callable[[tuple[Any, ...], Mapping[str, Any]], int]


def workload_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """Element count of the largest tensor among the arguments, looking one level into lists,
    tuples, dicts and dataclasses; 0 when there is none."""
    return max((t.numel() for t in _tensors([*args, *kwargs.values()])), default=0)


def workload_fn(model: object) -> WorkloadFn:
    """The model's own ``offload_workload(args, kwargs) -> int`` if it has one, else `workload_of`."""
    own = getattr(model, "offload_workload", None)
    return own if callable(own) else workload_of


def entry_signature(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple:
    """The shapes of a model call's tensor inputs: the same workload enters with the same
    shapes, so a workload can be recognised before its first block runs."""
    return tuple(tuple(t.shape) for t in _tensors([*args, *kwargs.values()]))


def scaled_workload(entry: tuple, known_entry: tuple, known_workload: int) -> int | None:
    """A guess at the workload of a call entering with ``entry``, from one that entered with
    ``known_entry``: the known workload scaled by the input that changed the most (a new
    resolution or frame count scales the tokens with the latents; the text states stay). None
    when the calls do not compare."""
    if len(entry) != len(known_entry) or any(len(a) != len(b) for a, b in zip(entry, known_entry, strict=True)):
        return None
    ratios = [max(_numel(new), 1) / max(_numel(old), 1) for new, old in zip(entry, known_entry, strict=True)]
    return int(known_workload * max(ratios, key=lambda r: abs(math.log(r)), default=1.0))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    for value in values:
        if torch.is_tensor(value):
            yield value
        else:
            yield from (child for child in _children(value) if torch.is_tensor(child))


def _children(value: Any) -> Iterable[Any]:
    if isinstance(value, (list, tuple)):
        return value
    if isinstance(value, Mapping):
        return value.values()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (getattr(value, f.name) for f in dataclasses.fields(value))
    return ()

"""Moving a module's tensors in place (same Parameter objects), bypassing ``ModelMixin.to``'s
guard on purpose: the engine is the one owner allowed to move a managed module.

A weight that is a tensor subclass with inner tensors (torchao) is never rebound through
``param.data`` (that moves only its wrapper): ``nn.Module.to`` swaps it whole, and `rebind` swaps
the resting tensor back into the same Parameter object (`formats.torchao`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..components import module_bytes
from ..formats.torchao import alias, is_wrapper, storage_bytes, swap_into


def move_module(module: torch.nn.Module, device: torch.device, non_blocking: bool = False) -> None:
    torch.nn.Module.to(module, device, non_blocking=non_blocking)


HostTensors = list[tuple[torch.nn.Module, str, bool, torch.Tensor]]


def host_tensors(module: torch.nn.Module) -> HostTensors:
    """Where each parameter and buffer lives now: (owner, name, is parameter, tensor)."""
    return [
        (sub, name, is_param, _resting(t) if is_param else t)
        for sub in module.modules()
        for is_param, table in ((True, sub._parameters), (False, sub._buffers))
        for name, t in table.items()
        if t is not None
    ]


def _resting(param: torch.Tensor) -> torch.Tensor:
    """What a parameter's data is now, as a tensor that stays there while the parameter moves."""
    return alias(param) if is_wrapper(param) else param.data


def rebind(saved: Iterable[tuple[torch.nn.Module, str, bool, torch.Tensor]]) -> None:
    """Point a module back at the tensors ``host_tensors`` recorded (same Parameter objects):
    a module that visited the device goes back without copying its weights out, since inference
    never writes them. A subclass weight is swapped back whole (each recorded tensor once)."""
    for sub, name, is_param, tensor in saved:
        put(sub, name, is_param, tensor)


def put(owner: torch.nn.Module, name: str, is_param: bool, tensor: torch.Tensor) -> None:
    """``owner``'s parameter (same Parameter object) or buffer ``name`` holds ``tensor`` now; a
    subclass weight is swapped in whole."""
    if is_param and is_wrapper(tensor):
        swap_into(owner._parameters[name], tensor)
    elif is_param:
        owner._parameters[name].data = tensor
    else:
        owner._buffers[name] = tensor


def bytes_on(module: torch.nn.Module, device: torch.device) -> int:
    """Storage bytes of ``module``'s tensors on ``device`` (a subclass weight: its inner tensors there)."""
    seen: set[int] = set()
    total = 0
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += storage_bytes(t, device)
    return total


__all__ = ["bytes_on", "host_tensors", "module_bytes", "move_module", "rebind"]

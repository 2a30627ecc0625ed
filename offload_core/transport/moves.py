"""Moving a module's tensors in place (same Parameter objects), bypassing ``ModelMixin.to``'s
guard on purpose: the engine is the one owner allowed to move a managed module."""

from __future__ import annotations

import torch

from ..components import module_bytes


def move_module(module: torch.nn.Module, device: torch.device, non_blocking: bool = False) -> None:
    torch.nn.Module.to(module, device, non_blocking=non_blocking)


HostTensors = list[tuple[torch.nn.Module, str, bool, torch.Tensor]]


def host_tensors(module: torch.nn.Module) -> HostTensors:
    """Where each parameter and buffer lives now: (owner, name, is parameter, tensor)."""
    return [(sub, name, is_param, t.data if is_param else t)
            for sub in module.modules()
            for is_param, table in ((True, sub._parameters), (False, sub._buffers))
            for name, t in table.items() if t is not None]


def rebind(saved: HostTensors) -> None:
    """Point a module back at the tensors ``host_tensors`` recorded (same Parameter objects):
    a module that visited the device goes back without copying its weights out, since inference
    never writes them."""
    for sub, name, is_param, tensor in saved:
        if is_param:
            sub._parameters[name].data = tensor
        else:
            sub._buffers[name] = tensor


def bytes_on(module: torch.nn.Module, device: torch.device) -> int:
    seen: set[int] = set()
    total = 0
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen and t.device == device:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


__all__ = ["bytes_on", "host_tensors", "module_bytes", "move_module", "rebind"]

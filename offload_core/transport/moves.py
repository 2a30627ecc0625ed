"""Moving a module's tensors in place (same Parameter objects), bypassing ``ModelMixin.to``'s
guard on purpose: the engine is the one owner allowed to move a managed module."""

from __future__ import annotations

import torch

from ..components import module_bytes


def move_module(module: torch.nn.Module, device: torch.device, non_blocking: bool = False) -> None:
    torch.nn.Module.to(module, device, non_blocking=non_blocking)


def bytes_on(module: torch.nn.Module, device: torch.device) -> int:
    seen: set[int] = set()
    total = 0
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen and t.device == device:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


__all__ = ["bytes_on", "module_bytes", "move_module"]

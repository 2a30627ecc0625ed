"""Resident: the whole component lives on the onload device until released (nothing to give
back: all or nothing, the host detaches the component instead)."""

from __future__ import annotations

import torch

from .base import MARKER, MarkerHook, TransportBase, TransportContext, add_hook, remove_hook
from .moves import bytes_on, move_module


class ResidentTransport(TransportBase):
    name = "resident"

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self._module: torch.nn.Module | None = None

    def apply(self, module: torch.nn.Module) -> None:
        self._module = module
        move_module(module, self.ctx.onload_device)
        add_hook(module, MarkerHook(self.ctx.onload_device), MARKER)

    def remove(self, module: torch.nn.Module) -> None:
        remove_hook(module, MARKER)
        move_module(module, self.ctx.offload_device)
        self._module = None

    def device_bytes(self) -> int:
        return bytes_on(self._module, self.ctx.onload_device) if self._module is not None else 0

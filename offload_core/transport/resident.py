"""Resident: the whole component lives on the onload device until released (nothing to give
back: all or nothing, the host detaches the component instead). Its ``encode``/``decode`` calls
ask the pipeline's other components for their working memory first (`workspace.py`)."""

from __future__ import annotations

import torch

from .. import state
from .base import MARKER, MarkerHook, TransportBase, TransportContext, add_hook, remove_hook
from .moves import bytes_on, move_module
from .workspace import Workspace


class ResidentTransport(TransportBase):
    name = "resident"

    def __init__(self, ctx: TransportContext, entries: tuple[str, ...] = ()) -> None:
        self.ctx = ctx
        self.entries = entries
        self._module: torch.nn.Module | None = None
        self.workspace = Workspace(ctx.memory, ctx.onload_device, ctx.owner) if ctx.owner and entries else None

    def apply(self, module: torch.nn.Module) -> None:
        self._module = module
        move_module(module, self.ctx.onload_device)
        add_hook(module, MarkerHook(self.ctx.onload_device), MARKER)
        if self.workspace is not None:
            for entry in self.entries:
                state.wrap_entry(module, entry, lambda method, entry=entry: self.workspace.wrap(entry, method))

    def remove(self, module: torch.nn.Module) -> None:
        state.unwrap_entries(module)
        remove_hook(module, MARKER)
        move_module(module, self.ctx.offload_device)
        self._module = None

    def details(self) -> dict[str, object]:
        """Out-of-memory errors its encode/decode calls met (each run again after a give-back)."""
        return {"ooms": self.workspace.ooms} if self.workspace is not None else {}

    def device_bytes(self) -> int:
        return bytes_on(self._module, self.ctx.onload_device) if self._module is not None else 0

"""On demand: the whole module rests in system memory and moves to the device when entered.

Entry points: ``encode``/``decode`` (diffusers' ``apply_forward_hook`` bridge calls
``module._hf_hook.pre_forward``), ``forward`` (marker hook), and blocks that fire ``_hf_hook`` by
hand before calling an inner model (MiniMax-H3's text encoder). Whole-module moves make tiled and
chunked calls find every weight loaded. After an ``encode``/``decode`` returns (its outputs are
materialised) the module goes back; a ``forward`` entry stays until a peer needs the room or the
run ends (a denoiser would otherwise bounce every step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..log import get_logger
from .base import MARKER, MarkerHook, TransportContext, add_hook, remove_hook
from .moves import HostTensors, bytes_on, host_tensors, module_bytes, move_module, rebind

log = get_logger("on_demand")
STAMP = "_diffusers_offload_on_demand"
# Working memory a module needs beside its weights while entered, as a fraction of them (a 5.2 GiB
# video VAE decoding 768x448 in chunks peaked at 0.5 GiB above its weights on the H200).
WORKSPACE_FRACTION = 0.25


class _Bridge:
    """Stands in ``module._hf_hook`` for diffusers' forward-hook bridge."""

    def __init__(self, transport: OnDemandTransport) -> None:
        self.transport = transport
        self.execution_device = transport.ctx.onload_device

    def pre_forward(self, module, *args, **kwargs):
        self.transport.onload()
        return args, kwargs

    def post_forward(self, module, output):
        return output


class OnDemandGroup:
    """The on-demand transports of one pipeline: entering one evicts the idle others and, when
    the device still lacks room, asks the pipeline's other components (kept denoiser blocks) for it
    through ``make_room(nbytes) -> freed``, which the engine binds."""

    def __init__(self) -> None:
        self.members: list[OnDemandTransport] = []
        self.make_room: Callable[[int], int] | None = None

    def evict_except(self, keep: OnDemandTransport) -> None:
        for other in self.members:
            if other is not keep and other.loaded and other.depth == 0:
                other.offload()

    def offload_all(self) -> None:
        for member in self.members:
            if member.depth == 0:
                member.offload()


class OnDemandTransport:
    name = "on-demand"

    def __init__(self, ctx: TransportContext, entries: tuple[str, ...] = ()) -> None:
        self.ctx = ctx
        self.entries = entries
        self.group: OnDemandGroup | None = ctx.owner if isinstance(ctx.owner, OnDemandGroup) else None
        self.module: torch.nn.Module | None = None
        self.loaded = False
        self.depth = 0
        self.moves = 0
        self._host: HostTensors = []  # the resting tensors while the module visits the device

    def apply(self, module: torch.nn.Module) -> None:
        self.module = module
        move_module(module, self.ctx.offload_device)
        if getattr(module, "_hf_hook", None) is not None:
            raise ValueError(
                f"{type(module).__name__} already carries an accelerate offload hook (_hf_hook): "
                "two offload systems cannot be stacked; remove enable_model_cpu_offload first"
            )
        module._hf_hook = _Bridge(self)
        setattr(module, STAMP, True)
        for entry in self.entries:
            setattr(module, entry, self._wrap(getattr(type(module), entry).__get__(module)))
        add_hook(module, MarkerHook(self.ctx.onload_device, on_enter=self.onload), MARKER)
        if self.group is not None:
            self.group.members.append(self)

    def remove(self, module: torch.nn.Module) -> None:
        remove_hook(module, MARKER)
        for entry in self.entries:
            module.__dict__.pop(entry, None)
        module.__dict__.pop("_hf_hook", None)
        module.__dict__.pop(STAMP, None)
        if self.group is not None and self in self.group.members:
            self.group.members.remove(self)
        self.offload()
        self.module = None

    def _wrap(self, method):
        @functools.wraps(method)
        def entered(*args, **kwargs):
            self.depth += 1
            try:
                self.onload()
                return method(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.offload()

        return entered

    def onload(self) -> None:
        if self.loaded or self.module is None:
            return
        if self.group is not None:
            self.group.evict_except(self)
            self._make_room()
        self._host = host_tensors(self.module)
        try:
            move_module(self.module, self.ctx.onload_device)
        except BaseException:  # an OOM half-way: leave no part of the module on the device
            self._rebind()
            raise
        self.loaded = True
        self.moves += 1
        log.debug("%s moved in whole", type(self.module).__name__)

    def _make_room(self) -> None:
        """Kept blocks are sized to the denoiser's activations; a VAE moving in after the
        denoiser finished needs them back, or its decode runs out of memory."""
        available = self.ctx.memory.device_available(self.ctx.onload_device)
        need = int(module_bytes(self.module) * (1 + WORKSPACE_FRACTION))
        if available is None or available >= need or self.group.make_room is None:
            return
        freed = self.group.make_room(need - available)
        log.info("%s: %.2f GiB short on %s to move in; the pipeline's other components gave back %.2f GiB",
                 type(self.module).__name__, (need - available) / 2**30, self.ctx.onload_device, freed / 2**30)

    def offload(self) -> None:
        """Back to the resting tensors: no copy out (a 5 GiB VAE took 1.8-4.5 s to copy out to
        pageable memory on the H200)."""
        if not self.loaded or self.module is None:
            return
        self._rebind()
        self.loaded = False
        self.moves += 1

    def _rebind(self) -> None:
        rebind(self._host)
        self._host = []

    def device_bytes(self) -> int:
        if self.module is None or self.ctx.onload_device == self.ctx.offload_device:
            return 0
        return bytes_on(self.module, self.ctx.onload_device)

    def pinned_bytes(self) -> int:
        return 0

    def give_back(self, nbytes: int) -> int:
        if self.depth or not self.loaded:
            return 0
        freed = self.device_bytes()
        self.offload()
        return freed

    def run_bytes(self) -> int:
        """The whole module, moved in on entry."""
        return 0 if self.module is None or self.loaded else module_bytes(self.module)

    def details(self) -> dict[str, object]:
        return {"entries": list(self.entries) or ["forward"], "loaded": self.loaded, "moves": self.moves}

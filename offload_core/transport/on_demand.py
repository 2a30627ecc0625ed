"""On demand: the whole module rests in system memory and moves to the device when entered.

Entry points: ``encode``/``decode`` (diffusers' ``apply_forward_hook`` bridge calls
``module._hf_hook.pre_forward``), ``forward`` (marker hook), and blocks that fire ``_hf_hook`` by
hand before calling an inner model (MiniMax-H3's text encoder). Whole-module moves make tiled and
chunked calls find every weight loaded. After an ``encode``/``decode`` returns (its outputs are
materialised) the module goes back, unless the group lets it ``stay`` (the engine sets that where a
denoiser's start sends idle modules home): then consecutive calls of one run (fl2va encodes two
keyframes) move it once, and it goes home at the run's end, when a denoiser starts, when a peer
needs the room, or when staying would leave less free than the working memory it asked for. A
``forward`` entry stays until a peer needs the room or the run ends (a denoiser would otherwise
bounce every step). When the pin budget grants it, the resting tensors are
page-locked in place (`pinning.PinSet`), so a move-in runs at the copy engine's speed.
torchao weights (tensor subclasses) are moved and put back whole (`moves.rebind`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import state
from ..formats.mapped import in_mapping
from ..formats.torchao import is_wrapper, map_inner
from ..log import get_logger
from ..pinning import PinSet
from .base import MARKER, MarkerHook, Masters, TransportBase, TransportContext, add_hook, remove_hook
from .moves import HostTensors, bytes_on, host_tensors, module_bytes, move_module, put, rebind

log = get_logger("on_demand")
# Working memory a module needs beside its weights while entered, as a fraction of them (a video
# VAE's chunked decode peaks about that far above its weights; see bench/README.md).
WORKSPACE_FRACTION = 0.25


class OnDemandGroup:
    """The on-demand transports of one pipeline: entering one evicts the idle others and, when
    the device still lacks room, asks the pipeline's other components (kept denoiser blocks) for it
    through ``make_room(nbytes) -> freed``, which the engine binds."""

    def __init__(self) -> None:
        self.members: list[OnDemandTransport] = []
        self.make_room: Callable[[int], int] | None = None
        self.stay = False  # an encode/decode leaves its module loaded for the run's next call

    def evict_except(self, keep: OnDemandTransport) -> None:
        for other in self.members:
            if other is not keep and other.loaded and other.depth == 0:
                other.offload()

    def offload_all(self) -> None:
        for member in self.members:
            if member.depth == 0:
                member.offload()


class OnDemandTransport(TransportBase):
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
        self.pins = PinSet()

    def apply(self, module: torch.nn.Module) -> None:
        self.module = module
        move_module(module, self.ctx.offload_device)
        if self.ctx.pin:
            self._pin_resting(module)
        state.install_bridge(module, self.onload, self.ctx.onload_device)
        for entry in self.entries:
            state.wrap_entry(module, entry, self._wrap)
        add_hook(module, MarkerHook(self.ctx.onload_device, on_enter=self.onload), MARKER)
        if self.group is not None:
            self.group.members.append(self)

    def remove(self, module: torch.nn.Module) -> None:
        remove_hook(module, MARKER)
        state.unwrap_entries(module)
        state.remove_bridge(module)
        if self.group is not None and self in self.group.members:
            self.group.members.remove(self)
        self.offload()
        self.pins.release()
        self.module = None

    def _pin_resting(self, module: torch.nn.Module) -> None:
        """Page-lock the resting tensors where they lie (`PinSet.pin_all`: a pinned copy stands in
        where a storage cannot be registered; a subclass weight's inner tensors one by one, swapped
        in whole)."""
        rows = host_tensors(module)
        plain = iter(self.pins.pin_all([t for *_, t in rows if not is_wrapper(t)], in_mapping()))
        for owner, name, is_param, t in rows:
            pinned = map_inner(t, self.pins.pin) if is_wrapper(t) else next(plain)
            if pinned is not t:
                put(owner, name, is_param, pinned)

    def _wrap(self, method: Callable) -> Callable:
        def entered(*args, **kwargs):
            self.depth += 1
            try:
                self.onload()
                return method(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0 and not (self.group is not None and self.group.stay and self._room_to_stay()):
                    self.offload()

        return entered

    def _room_to_stay(self) -> bool:
        """Staying loaded after a call must leave the pipeline the working memory the module asked
        for on entry: the code after a decode (float post-processing of the whole video) allocates
        outside any component, and a module kept beside it would run it out of memory."""
        available = self.ctx.memory.device_available(self.ctx.onload_device)
        room = int(module_bytes(self.module) * WORKSPACE_FRACTION)
        if available is None or available >= room:
            return True
        log.info("%s goes home after its call: %.2f GiB free on %s, under the %.2f GiB it leaves the pipeline",
                 type(self.module).__name__, available / 2**30, self.ctx.onload_device, room / 2**30)
        return False

    def onload(self) -> None:
        if self.loaded or self.module is None:
            return
        if self.group is not None:
            self.group.evict_except(self)
            self._make_room()
        self._host = host_tensors(self.module)
        try:
            if self.pinned_bytes():  # from page-locked memory the copy runs asynchronously, stream-ordered
                move_module(self.module, self.ctx.onload_device, non_blocking=True)
            else:
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
        log.info(
            "%s: %.2f GiB short on %s to move in; the pipeline's other components gave back %.2f GiB",
            type(self.module).__name__,
            (need - available) / 2**30,
            self.ctx.onload_device,
            freed / 2**30,
        )

    def offload(self) -> None:
        """Back to the resting tensors: no copy out (copying a VAE out to pageable memory takes
        seconds; the weights were never written)."""
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
        return self.pins.nbytes

    def offload_idle(self) -> bool:
        if not self.loaded or self.depth:
            return False
        self.offload()
        return True

    def masters(self) -> Masters:
        """While visiting the device, the resting tensors the module goes back to."""
        return {id(owner._parameters[name]): [t] for owner, name, is_param, t in self._host if is_param}

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

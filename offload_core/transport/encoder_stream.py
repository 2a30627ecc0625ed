"""A text encoder's layers through the block streamer, from pinned memory (SPEC §2, §13).

Why: from pageable memory a text encoder's leaf groups move at ~1 GB/s (H3's 62 GiB Qwen3-VL took
62 s a run); streamed from page-locked memory its layers move at the copy engine's speed on the
side stream. Used wherever the pin budget grants some of it: under a partial grant (a host short of
RAM) the non-layer part and the first layers are pinned and the rest go through the streamer's
pinned staging buffers, still on the side stream; a denial leaves diffusers' leaf groups. Two
differences from a denoiser's streamer: no preload planner (the encoder runs
once per run; no measures are taken or kept under any identity), and the non-layer part (the
embeddings, final norm, a VLM's vision tower and head) is not resident for the whole placement:
it rests in (pinned) host memory, moves in when one of its modules is entered, and goes home,
with the layers' streaming buffers, at the end of the run, when the denoiser starts (`Engine`
parks idle components), or when another component asks for room, so that neither takes the
denoiser's preload room. Where the device is short (before the non-layer part moves in, or an
out-of-memory error in a layer) the pipeline's other components give room back (the denoisers'
kept blocks, idle on-demand modules), never this encoder's own part while it runs.

Whole layers only: a T5 block's large children are its ``layer`` ModuleList (no forward of its
own), so streaming T5 in parts would bind nothing. Forwards are told apart by the layers, not by
the model's entry: MiniMax-H3 calls the inner ``text_encoder.model`` (the marker on the wrapper
never fires), and a VLM's order differs with and without images: a layer entered at or below a
depth its stack already ran in this forward begins the next forward. A forward that stops early
(an interrupt between layers) learns no order that drops the layers it did not reach
(`OrderLearner.learn`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..components import module_bytes
from ..formats.mapped import in_mapping
from ..log import get_logger
from .base import MarkerHook, Masters
from .blocks import StreamBlock, modules_outside, nbytes
from .moves import put, rebind
from .streamer import BlockStreamer
from .towers import find_towers

log = get_logger("encoder_stream")
# The layers must be most of the encoder: otherwise streaming them saves little and the rest
# would visit the device whole on every entry.
MIN_TOWER_SHARE = 0.5


def streamable(module: torch.nn.Module) -> bool:
    """Whether ``module``'s layer stacks (``towers.find_towers``) hold most of its bytes."""
    towers = find_towers(module)
    total = module_bytes(module)
    return bool(towers) and total > 0 and sum(t.nbytes for t in towers) >= MIN_TOWER_SHARE * total


class EncoderStreamer(BlockStreamer):
    """Layers streamed per forward; the rest moves in on entry and goes home when idle."""

    name = "encoder-stream"
    graphed = False  # a prompt runs it once: nothing to replay
    compiles = False  # and each new prompt length would compile again

    def __init__(self, ctx) -> None:
        # Whole layers (see the module docstring: a T5 block's one large child has no forward).
        super().__init__(dataclasses.replace(ctx, config=ctx.config.replace(stream_parts=False)))
        self._head: dict[int, tuple[torch.nn.Module, str, bool, torch.Tensor]] = {}
        self.head_loaded = False
        self.head_moves = 0
        self._asking = False  # asking the pipeline for room: its give_back must not take this part
        self._head_pinned = False  # under a partial grant, the part is pinned first where it fits

    def block_grant(self) -> int | None:
        """A partial grant less what the non-layer part pinned first (it moves in every run too)."""
        grant = self.ctx.pin_bytes
        return None if grant is None else max(grant - self.pins.nbytes, 0)

    def _move_head(self, module: torch.nn.Module, tower_ids: set[int], device: torch.device) -> None:
        """At apply: note (and pin) the non-layer tensors where they rest, hook their modules;
        at remove: back to the resting tensors."""
        if device == self.ctx.offload_device and not tower_ids:
            self._head_out()
            self._head = {}
            return
        own: dict[int, tuple[torch.nn.Module, str, bool, torch.Tensor]] = {}  # a shared tensor: its first owner
        for sub in modules_outside(module, tower_ids):
            for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
                for name, t in table.items():
                    if t is not None:
                        own.setdefault(id(t), (sub, name, is_param, t))
        grant = self.ctx.pin_bytes
        self._head_pinned = self.ctx.pin and (grant is None or sum(nbytes(t) for *_, t in own.values()) <= grant)
        hosts = [t.data if t.device == self.ctx.offload_device else t.data.to(self.ctx.offload_device)
                 for *_, t in own.values()]
        hosts = self.pins.pin_all(hosts, in_mapping()) if self._head_pinned else hosts
        for (sub, name, is_param, t), host in zip(own.values(), hosts, strict=True):
            if is_param:
                t.data = host
            else:
                sub._buffers[name] = host
            self._head[id(t)] = (sub, name, is_param, host)
        owners = {id(sub) for sub, _name, _is_param, _host in self._head.values()}
        for sub in modules_outside(module, tower_ids):
            # Containers too (``text_encoder.model``): the part is in before their forward reads any of it.
            if sub is not module and not isinstance(sub, (torch.nn.ModuleList, torch.nn.ModuleDict)) and any(
                    id(m) in owners for m in modules_outside(sub, tower_ids)):
                self._hook(sub, MarkerHook(self.device, on_enter=self._head_in))

    def begin_forward(self, args: tuple, kwargs: dict) -> None:
        self._head_in()
        super().begin_forward(args, kwargs)

    @torch.compiler.disable
    def enter_block(self, block: StreamBlock, args: tuple, kwargs: dict) -> None:
        """A layer entered at or below a depth its stack already ran in this forward: a new forward."""
        if not self._forward_open and any(self.units[i].block.tower == block.tower
                                          and self.units[i].block.depth >= block.depth for i in self.learner.seen):
            self._forward_open = True
        return super().enter_block(block, args, kwargs)

    def _head_in(self) -> None:
        if self.head_loaded or self.device == self.ctx.offload_device:
            return
        available = self.ctx.memory.device_available(self.device)
        need = self.head_bytes() + super().run_bytes()
        if available is not None and available < need:
            self._ask_room(need - available, "to move its non-layer part in")
        blocking = not (self._head_pinned and self.cuda)
        for sub, name, is_param, host in self._head.values():
            put(sub, name, is_param, host.to(self.device, non_blocking=not blocking))
        self.head_loaded = True
        self.head_moves += 1
        log.debug("%s: non-layer part moved in (%.2f GiB)", type(self.module).__name__, self.head_bytes() / 2**30)

    def _head_out(self) -> None:
        """Back to the resting tensors (no copy out: inference never writes them)."""
        if not self.head_loaded:
            return
        rebind(self._head.values())
        self.head_loaded = False

    def after_run(self) -> None:
        super().after_run()
        self.offload_idle()

    def _ask_room(self, nbytes: int, why: str) -> int:
        """The pipeline's other components free up to ``nbytes`` (`Engine.give_back` through the
        on-demand group's ``make_room``); this encoder's own part stays while it asks."""
        make_room = getattr(self.ctx.owner, "make_room", None)
        if make_room is None or nbytes <= 0:
            return 0
        self._asking = True
        try:
            freed = make_room(nbytes)
        finally:
            self._asking = False
        log.info("%s: %.2f GiB short on %s %s; the pipeline's other components gave back %.2f GiB",
                 type(self.module).__name__, nbytes / 2**30, self.device, why, freed / 2**30)
        return freed

    def relieve_in(self, block: StreamBlock) -> bool:
        """Out of memory in a layer: no planner here, so the pipeline gives room back."""
        return super().relieve_in(block) or self._ask_room(self.ring.slot_bytes or block.nbytes, "in a layer") > 0

    def relieve_outside_blocks(self, first: bool) -> bool:
        return (super().relieve_outside_blocks(first)
                or self._ask_room(self.head_bytes() + self.ring.slot_bytes, "outside its layers") > 0)

    def give_back(self, nbytes: int) -> int:
        if self._asking:  # its own part and buffers stay while it asks the others for room
            return 0
        freed = super().give_back(nbytes)
        if freed < nbytes and self.head_loaded:
            freed += self.head_bytes()
            self._head_out()
        return freed

    def offload_idle(self) -> bool:
        """Idle (a denoiser starts, the run ends): the non-layer part goes home and the streaming
        buffers go, so that neither takes the denoiser's room; True when anything left."""
        dropped = self.drop_prefetched() > 0
        if not self.head_loaded:
            return dropped
        self._head_out()
        return True

    def device_bytes(self) -> int:
        held = super().device_bytes()
        return held if self.head_loaded or not held else held - self.head_bytes()

    def run_bytes(self) -> int:
        return super().run_bytes() + (0 if self.head_loaded else self.head_bytes())

    def masters(self) -> Masters:
        out = super().masters()
        for sub, name, is_param, host in self._head.values():
            if is_param and self.head_loaded:
                out.setdefault(id(sub._parameters[name]), []).append(host)
        return out

    def details(self) -> dict[str, object]:
        return {**super().details(), "head_loaded": self.head_loaded, "head_moves": self.head_moves}

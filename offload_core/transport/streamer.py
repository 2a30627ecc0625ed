"""Block streamer: the per-step transport for denoisers (vocabulary: `blocks.py`).

Why not diffusers' block-level group offload: it cannot change which blocks stay resident between
steps without re-hooking (preload needs that), it moves the non-block part from pageable memory
every forward, and it pins a second, rounded-up copy of every weight. Here the non-block part is
resident; each block's weights stay where they are in host memory, page-locked in place, as the
master copy; a forward binds a unit's tensors to views of a ring buffer (`ring.py`) filled on a
side stream in *execution* order (recorded, `order.py`), and rebinds them to the host copy after.
A unit that was not prefetched loads synchronously: a wrong guess costs time, never correctness.
Any set of pieces can be kept resident between steps (``set_resident``), without re-hooking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from diffusers.hooks import ModelHook

from ..log import get_logger
from ..pinning import PinSet
from .base import (
    MARKER,
    STREAM_HOOK,
    MarkerHook,
    Masters,
    TransportBase,
    TransportContext,
    add_hook,
    remove_hook,
)
from .blocks import StreamBlock, StreamPiece, StreamUnit, make_block, make_pieces
from .events import Events
from .order import ExecutionOrder
from .ring import BufferRing, RingSlot
from .towers import find_towers

log = get_logger("streamer")


T = TypeVar("T")


def retry_on_oom(run: Callable[[], T], relieve: Callable[[int], bool]) -> T:
    """``run()``; on an allocator out-of-memory error, ``relieve(attempt)`` and run again while
    it freed something (attempt counts from 0); the error goes up when nothing more can go."""
    attempt = 0
    while True:
        try:
            return run()
        except torch.OutOfMemoryError:
            if not relieve(attempt):
                raise
            attempt += 1


class _BlockHook(ModelHook):
    def __init__(self, streamer: BlockStreamer, block: StreamBlock) -> None:
        super().__init__()
        self.streamer, self.block = streamer, block

    def pre_forward(self, module, *args, **kwargs):
        self.streamer.enter_block(self.block, args, kwargs)
        return args, kwargs

    def new_forward(self, module, *args, **kwargs):
        """On an OOM inside the block the planner gives kept blocks up and the block runs again:
        the step continues while there is anything left to give up."""
        return retry_on_oom(lambda: self.fn_ref.original_forward(*args, **kwargs),
                            lambda _attempt: self.streamer.relieve_in(self.block))

    def post_forward(self, module, output):
        if not self.block.in_parts:
            self.streamer.exit(self.block.units[0])
        return output


class _PartHook(ModelHook):
    """On a large child of a block streamed in parts: its weights are bound for its forward
    only (an OOM inside goes up to the block's retry)."""

    def __init__(self, streamer: BlockStreamer, unit: StreamUnit) -> None:
        super().__init__()
        self.streamer, self.unit = streamer, unit

    def pre_forward(self, module, *args, **kwargs):
        self.streamer.enter(self.unit)
        return args, kwargs

    def post_forward(self, module, output):
        self.streamer.exit(self.unit)
        return output


class _ModelHook(MarkerHook):
    """The marker on the denoiser: announces each forward, and retries one that ran out of memory
    outside the blocks (the first forward of a larger workload allocates its inputs before the
    first block, where the plan for it is made): first without the blocks copied ahead, then with
    kept blocks given up."""

    def __init__(self, streamer: BlockStreamer) -> None:
        super().__init__(streamer.device)
        self.streamer = streamer

    def pre_forward(self, module, *args, **kwargs):
        self.streamer.begin_forward(args, kwargs)
        return args, kwargs

    def new_forward(self, module, *args, **kwargs):
        return retry_on_oom(lambda: self.fn_ref.original_forward(*args, **kwargs),
                            lambda attempt: self.streamer.relieve_outside_blocks(first=attempt == 0))


class BlockStreamer(TransportBase):
    name = "per-step"

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.device = ctx.onload_device
        self.blocks: list[StreamBlock] = []
        self.units: list[StreamUnit] = []
        self.pieces: list[StreamPiece] = []
        self.module: torch.nn.Module | None = None
        self.pins = PinSet()
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda and ctx.streams else None
        self.order = ExecutionOrder([], lambda u: self.units[u].piece.resident is None)  # as the last cycle ran
        self._guessed: set[str] = set()  # towers whose parts' order is still the registration order
        self._seen: list[int] = []
        self.ring = BufferRing(self.device, ctx.prefetch_window + 1)
        self._inflight: dict[int, RingSlot] = {}
        self._bound: dict[int, RingSlot] = {}
        self._head_bytes = 0
        self._transit_peak = 0
        self.ooms = 0  # out-of-memory errors met in the hooks (torch counts none under cudaMallocAsync)
        self.events = Events()  # forward, cycle, oom, end: see events.py

    # -- apply / remove -------------------------------------------------------------------
    def apply(self, module: torch.nn.Module) -> None:
        self.module = module
        towers = find_towers(module)
        tower_ids = {id(b) for t in towers for b in t.blocks}
        self._head_bytes = self._move_head(module, tower_ids, self.device)
        for tower in towers:
            for depth, block in enumerate(tower.blocks):
                made = make_block(len(self.blocks), tower.name, depth, block, parts=self.ctx.stream_parts,
                                  host_of=self._host_master, pinned=self.ctx.pin and self.cuda,
                                  device=self.device, first_unit=len(self.units))
                self._head_bytes += made.rest_bytes
                self.blocks.append(made)
                self.units.extend(made.units)
                self.pieces.extend(make_pieces(made, len(self.pieces)))
        for block in self.blocks:
            add_hook(block.module, _BlockHook(self, block), STREAM_HOOK)
            for unit in block.units if block.in_parts else ():
                add_hook(unit.module, _PartHook(self, unit), STREAM_HOOK)
        add_hook(module, _ModelHook(self), MARKER)
        self.order.set([u.index for u in self.units])
        self._guessed = {b.tower for b in self.blocks if b.in_parts}
        self.ring.resize(self._largest_streamed())
        log.info(
            "%s: %d blocks in %d tower(s) streamed in %d units (%.2f GiB/step, buffers of %.2f GiB, %s, %s), "
            "non-block part resident (%.2f GiB)",
            type(module).__name__, len(self.blocks), len(towers), len(self.units), self.streamed_bytes() / 2**30,
            self.ring.slot_bytes / 2**30, "side-stream prefetch" if self.copy_stream else "no stream",
            "pinned" if self.ctx.pin and self.cuda else "pageable", self.head_bytes() / 2**30,
        )

    def remove(self, module: torch.nn.Module) -> None:
        remove_hook(module, MARKER)
        for block in self.blocks:
            remove_hook(block.module, STREAM_HOOK)
            for unit in block.units if block.in_parts else ():
                remove_hook(unit.module, STREAM_HOOK)
            block.bind_host()
        for piece in self.pieces:
            piece.resident = None
        self._unbind_all()
        self.drop_prefetched()
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.pins.release()
        self.blocks.clear()
        self.units.clear()
        self.pieces.clear()
        self._move_head(module, set(), self.ctx.offload_device)
        self.module = None

    def _move_head(self, module: torch.nn.Module, tower_ids: set[int], device: torch.device) -> int:
        """Move every tensor outside the tower blocks to ``device``; return their bytes."""
        total = 0
        for sub in _modules_outside(module, tower_ids):
            for t in (*sub._parameters.values(), *sub._buffers.values()):
                if t is not None:
                    if t.device != device:
                        t.data = t.data.to(device)
                    total += t.numel() * t.element_size()
        return total

    def _host_master(self, t: torch.Tensor) -> torch.Tensor:
        """The host copy a streamed tensor rests in: where it already lies, page-locked in place."""
        host = t.data if t.device == self.ctx.offload_device else t.data.to(self.ctx.offload_device)
        return self.pins.pin(host) if self.ctx.pin else host

    # -- the per-forward path ---------------------------------------------------------------
    def enter_block(self, block: StreamBlock, args: tuple, kwargs: dict) -> None:
        """A block is entered: a cycle begins at the first block; a whole block is made ready."""
        if block is self.units[self.order.first()].block or not self._seen:
            self._begin_cycle(block, args, kwargs)
        elif self._guessed:
            self._learn_part_order()
        if not block.in_parts:
            self.enter(block.units[0])

    def enter(self, unit: StreamUnit) -> None:
        self._seen.append(unit.index)
        retry_on_oom(lambda: self._make_ready(unit), lambda _attempt: self.relieve_in(unit.block))

    def relieve_in(self, block: StreamBlock) -> bool:
        """An allocation inside ``block`` failed: the listeners (the planner) give kept pieces
        up, never ``block``'s; False when nothing could go."""
        self.ooms += 1
        return self.notify("oom", block=block)

    def _make_ready(self, unit: StreamUnit) -> None:
        if unit.piece.resident is None and unit.index not in self._bound:
            if unit.index not in self._inflight:
                self._drop_wrong_guesses(unit)
            slot = self._take(unit)
            self._bound[unit.index] = slot
            unit.bind(self._views(unit, slot))
        self._prefetch_after(unit)
        self._transit_peak = max(self._transit_peak, self._transit_bytes())

    def exit(self, unit: StreamUnit) -> None:
        slot = self._bound.pop(unit.index, None)
        if slot is not None:
            unit.bind_host()
            self.ring.release(slot, read_by_compute=True)
            # Its buffer's next user. On an OOM that block loads at its entry instead, where an
            # OOM gives kept blocks up.
            try:
                self._prefetch_after(unit)
            except torch.OutOfMemoryError:
                self.ooms += 1

    def _unbind_all(self) -> None:
        for index in list(self._bound):
            self.units[index].bind_host()
            self.ring.release(self._bound.pop(index), read_by_compute=True)

    def _learn_part_order(self) -> None:
        """First forward, a block entered after one that ran in parts: guess its tower's other
        blocks' parts in the order that one ran them, and refill the prefetch by it. Parts are
        registered in one order and may run in another (H3's blocks compute their modulation,
        registered last, first): in the first forward every part was otherwise a missed prefetch
        that loaded synchronously (H3 at full width: 0.76 s against 0.49 s whole)."""
        done = self.units[self._seen[-1]].block
        if done.tower not in self._guessed:
            return
        ran = [i - done.units[0].index for i in _dedupe([i for i in self._seen if self.units[i].block is done])]
        if len(ran) != len(done.units):
            return
        self._guessed.discard(done.tower)
        if ran == sorted(ran):
            return
        like = [b for b in self.blocks if b.tower == done.tower and len(b.units) == len(done.units)]
        guess = {u.index: b.units[ran[k]].index for b in like for k, u in enumerate(b.units)}
        self.order.set([guess.get(i, i) for i in self.order.units])
        self._prefetch_after(self.units[self._seen[-1]])

    def _begin_cycle(self, block: StreamBlock, args: tuple, kwargs: dict) -> None:
        if len(self._seen) >= len(self.order.units) // 2 and self._seen:
            self.order.set(_dedupe(self._seen))
            self._guessed.clear()
        self._seen = []
        self._unbind_all()  # a forward that raised never reached exit()
        self.notify("cycle", block=block, args=args, kwargs=kwargs)

    def notify(self, event: str, **info) -> bool:
        """Tell listeners (the preload driver) about a cycle start, an OOM, a run end; True when
        one of them acted (an OOM was relieved)."""
        return self.events.emit(event, self, **info)

    def _take(self, unit: StreamUnit) -> RingSlot:
        slot = self._inflight.pop(unit.index, None)
        if slot is None:
            slot = self._load(unit)
        if slot.written is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.written)
        return slot

    def _drop_wrong_guesses(self, unit: StreamUnit) -> None:
        """``unit`` was not prefetched (a new plan, a skipped branch): the units in flight that
        will not run after it give their buffers back first, so it loads into one of them rather
        than into a buffer allocated beside them while the step's activations are live."""
        after = self.ring.capacity - 1 - len(self._bound)
        keep = set(self.order.upcoming(unit.index, after))
        for index in [i for i in self._inflight if i not in keep]:
            self._discard(index)

    def begin_forward(self, args: tuple, kwargs: dict) -> None:
        """The denoiser is entered: its listeners settle the plan, then the first streamed units
        that are not in flight yet are copied, before the non-block part is even launched."""
        self.notify("forward", args=args, kwargs=kwargs)
        try:
            self._prefetch_after(None)
        except torch.OutOfMemoryError:  # they load at their entry instead, where an OOM is relieved
            self.ooms += 1

    def _prefetch_after(self, unit: StreamUnit | None) -> None:
        """Keep exactly the next streamed units after ``unit`` (``None``: the forward's first)
        in flight that fill the ring's buffers with the one bound now, if any. Past the last
        block, the next forward's first ones, but one buffer fewer: that one is filled when the
        next forward begins (`begin_forward`). Why: where the host waits for each step's end (a
        progress bar, a preview), a ring filled across the boundary leaves the copy engine idle
        until the first streamed unit has run; the copy queued at the model's entry starts at
        once, and the ones queued at the last block still overlap the forward's tail."""
        if self.copy_stream is None:
            return
        count = self.ring.capacity - len(self._bound)
        index = None if unit is None else unit.index
        upcoming = self.order.upcoming(index, count, next_forward=self.ring.capacity - 1)
        for index in list(self._inflight):
            if index not in upcoming:
                self._discard(index)  # a skipped branch, a changed plan
        for index in upcoming:
            if index not in self._inflight:
                self._inflight[index] = self._load(self.units[index])

    def _load(self, unit: StreamUnit) -> RingSlot:
        """Copy a streamed unit into a ring slot, once the compute work that last read the
        slot is done (usually the unit that has just exited: the copy overlaps what runs next)."""
        slot = self.ring.acquire()
        pairs = zip(self._views(unit, slot), (s.host for s in unit.slots), strict=True)
        slot.written = self._copy(pairs, unit.block.pinned, after=slot.read)
        return slot

    @staticmethod
    def _views(unit: StreamUnit, slot: RingSlot) -> list[torch.Tensor]:
        """``unit``'s tensors in ``slot``'s buffer, made once per buffer and unit: a step uses
        them twice per streamed unit (copy, bind), and building them is most of the host time a
        streamed block costs (0.8 of 1.1 ms per block in a CPU profile)."""
        views = slot.views.get(unit.index)
        if views is None:
            views = slot.views[unit.index] = unit.views(slot.buf)
        return views

    def _copy(self, pairs, pinned: bool, after: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """Copy each (device view, host master) pair: on the side stream after ``after``,
        returning the event that marks the copy done, or on the compute stream where there is
        no side stream."""
        stream = self.copy_stream
        if stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=pinned)
            return stream.record_event()

    # -- resident set (preload) ---------------------------------------------------------------
    def set_resident(self, indices: set[int]) -> None:
        """Keep exactly the pieces ``indices`` resident; called between forwards (no
        re-hooking). Pieces leaving go before pieces arriving, so a set that moves needs no
        room for both."""
        for piece in self.pieces:
            if piece.index not in indices and piece.resident is not None:
                piece.bind_host()
                piece.resident = None
        for piece in self.pieces:
            if piece.index in indices and piece.resident is None:
                for unit in piece.units:
                    if unit.index in self._inflight:
                        self._discard(unit.index)
                piece.resident = self._load_resident(piece)
        self.order.refresh()
        largest = self._largest_streamed()
        if largest != self.ring.slot_bytes:
            self.drop_prefetched()
            self.ring.resize(largest)

    def set_lookahead(self, buffers: int) -> None:
        """How many streaming buffers to fill ahead (at least the window's ``window + 1``)."""
        buffers = max(buffers, self.ctx.prefetch_window + 1)
        if buffers != self.ring.capacity:
            for index in list(self._inflight)[buffers - len(self._bound):]:
                self._discard(index)
            self.ring.set_capacity(buffers)

    def fill_ring(self) -> bool:
        """With prefetch on, make the ring's missing buffers now (a planned change: see
        `BufferRing.fill`); True when any was made."""
        return self.copy_stream is not None and self.ring.fill()

    def _load_resident(self, piece: StreamPiece) -> torch.Tensor:
        """A kept piece's own buffer, its units bound to it. From the compute stream's pool: the
        copy waits for the compute work queued so far, which may still read that memory, and the
        compute stream for the copy."""
        buf = torch.empty(piece.nbytes, dtype=torch.uint8, device=self.device)
        after = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        per_unit = list(zip(piece.units, piece.views(buf), strict=True))
        pairs = [(view, slot.host) for unit, views in per_unit for view, slot in zip(views, unit.slots, strict=True)]
        ready = self._copy(pairs, piece.block.pinned, after)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        for unit, views in per_unit:
            unit.bind(views)
        return buf

    def _largest_streamed(self) -> int:
        """The ring's buffer size: the largest unit of the pieces not kept."""
        return max((p.largest_unit for p in self.pieces if p.resident is None), default=0)

    def relieve_outside_blocks(self, first: bool) -> bool:
        """Free memory for a forward that ran out of it outside the blocks; False when nothing can
        go. Giving the streaming buffers back (and the blocks copied into them) is tried on the
        ``first`` failure only: a forward refills them, so only giving kept blocks up, which runs
        out, may repeat."""
        self.ooms += 1
        self._unbind_all()
        self._seen = []  # the forward runs again from the start
        if first and self.ring.nbytes:
            self.drop_prefetched()
            return True
        return self.notify("oom", block=None)

    def drop_prefetched(self) -> None:
        """Forget the blocks copied ahead (they would be stale after a write to the host copies)
        and give the idle ring buffers back to the allocator."""
        for index in list(self._inflight):
            self._discard(index)
        self.ring.clear()

    def _discard(self, index: int) -> None:
        """A prefetched block will not run next (a skipped branch, a changed plan): its slot
        goes back to the ring unread."""
        self.ring.release(self._inflight.pop(index), read_by_compute=False)

    def pieces_of(self, blocks: set[int]) -> set[int]:
        """The pieces of the blocks ``blocks`` (block-table indices): keeping blocks whole."""
        return {p.index for p in self.pieces if p.block.index in blocks}

    def resident_blocks(self) -> set[int]:
        """Blocks with every piece resident."""
        return {b.index for b in self.blocks if all(u.piece.resident is not None for u in b.units)}

    def resident_indices(self) -> set[int]:
        return {p.index for p in self.pieces if p.resident is not None}

    def after_run(self) -> None:
        """Drop prefetched buffers at the end of a pipeline run (nothing runs the next block)."""
        self.notify("end")
        self._unbind_all()
        self.drop_prefetched()
        self._seen = []

    def weights_at_peak(self) -> int:
        """Weight bytes on the device when the allocator peaked: the resident part plus the most
        streamed-block buffers that were alive at once this cycle (the peak happens inside a block,
        with its successor prefetched)."""
        return self._head_bytes + self.kept_bytes() + self._transit_peak

    def reset_peak(self) -> None:
        self._transit_peak = self._transit_bytes()

    def _transit_bytes(self) -> int:
        return self.ring.nbytes

    # -- accounting -------------------------------------------------------------------------
    def head_bytes(self) -> int:
        return self._head_bytes

    def streamed_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces if p.resident is None)

    def kept_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces if p.resident is not None)

    def device_bytes(self) -> int:
        """Weights on the device now: the resident part, kept and bound blocks, prefetched buffers
        (read from the block table, not by walking every tensor: it runs once per forward)."""
        if self.module is None or self.device == self.ctx.offload_device:
            return 0
        return self._head_bytes + self.kept_bytes() + self._transit_bytes()

    def pinned_bytes(self) -> int:
        return self.pins.nbytes

    def masters(self) -> Masters:
        """Each streamed tensor's host master (a kept piece's device copy is its live ``.data``)."""
        return {id(slot.tensor): [slot.host] for block in self.blocks for slot in block.slots}

    def before_write(self) -> None:
        self.drop_prefetched()  # copies made ahead of a weight write would be stale

    def give_back(self, nbytes: int) -> int:
        """Release kept pieces, last in the table first, until ``nbytes`` are freed."""
        freed = 0
        keep = self.resident_indices()
        for piece in reversed(self.pieces):
            if freed >= nbytes:
                break
            if piece.resident is not None:
                keep.discard(piece.index)
                freed += piece.nbytes
        self.set_resident(keep)
        return freed

    def run_bytes(self) -> int:
        """The streaming slots: the unit being run plus those filled ahead."""
        return self.ring.capacity * self._largest_streamed()

    def details(self) -> dict[str, object]:
        return {
            "blocks": len(self.blocks),
            "pieces": len(self.pieces),
            "kept": len(self.resident_blocks()),  # whole blocks
            "kept_pieces": len(self.resident_indices()),
            "kept_bytes": self.kept_bytes(),
            "streamed_per_step": self.streamed_bytes(),
            "stream": self.copy_stream is not None,
            "window": self.ctx.prefetch_window,
            "buffers": self.ring.capacity,
            "units": len(self.units),
            "ooms": self.ooms,
        }


def _modules_outside(root: torch.nn.Module, skip: set[int]):
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in skip:
            continue
        yield module
        stack.extend(module.children())


def _dedupe(seq: list[int]) -> list[int]:
    return list(dict.fromkeys(seq))

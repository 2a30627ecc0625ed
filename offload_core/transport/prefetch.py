"""The streamer's copies: which streamed units sit in the ring's buffers, bound or copied ahead.

A unit is bound to a ring buffer for its forward (``bind``/``release``); while it computes, the
next streamed units in execution order are copied into the other buffers on the side stream
(``prefetch_after``). A buffer is written after the compute work that last read it (an event per
buffer, not a wait for all queued compute) and read on the compute stream after its copy; the
buffers belong to the compute stream's pool, so ``record_stream`` is never needed here.
A unit whose host copy is not page-locked (pinning off, denied, or partly granted) goes through
the pinned staging buffers of `staging.py` on the same side stream.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .blocks import StreamBlock, StreamPiece, StreamUnit
from .cast import CastPool, cast_into, compute_views
from .order import ExecutionOrder
from .ring import BufferRing, RingSlot
from .staging import StagingRing

Pairs = Iterable[tuple[torch.Tensor, torch.Tensor]]  # (device view, host master)


class Prefetcher:
    def __init__(self, device: torch.device, units: list[StreamUnit], order: ExecutionOrder,
                 buffers: int, side_stream: bool) -> None:
        self.device = device
        self.units = units  # the streamer's unit table (shared, filled at apply)
        self.order = order
        self.ring = BufferRing(device, buffers)
        self.copy_stream = torch.cuda.Stream(device) if side_stream and device.type == "cuda" else None
        self.inflight: dict[int, RingSlot] = {}  # copied ahead, not bound yet
        self.bound: dict[int, RingSlot] = {}  # bound for a forward running now
        self.sync_loads = 0  # streamed units that were not copied ahead (with a side stream)
        self.copied = 0  # tensor bytes copied to the device (streamed units, kept pieces): the benches' count
        self.casts = CastPool(device)  # compute buffers of the fp8 units bound now
        self.cast_bound: dict[int, torch.Tensor] = {}  # unit index -> its compute buffer
        # unpinned units reach the device through pinned staging buffers, on the side stream
        self.staging = StagingRing(self.copy_stream) if self.copy_stream is not None else None
        self.capturing = False  # a kept block's forward is being captured as a CUDA graph
        self._captured: dict[int, torch.Tensor] = {}  # unit index -> the fixed cast buffer it is bound to, in a capture

    def bind(self, unit: StreamUnit, cast: bool = True) -> None:
        """Make a unit's weights ready on the device (a kept one already is, but for its fp8
        weights' cast; ``cast`` False: its stored bytes bound, cast later by `cast` or inside a
        graph), then keep the units after it copying."""
        if not self.ready(unit):
            if unit.piece.resident is None:
                if unit.index not in self.inflight:
                    self.sync_loads += self.copy_stream is not None
                    self._drop_wrong_guesses(unit)
                self.bound[unit.index] = self._take(unit)
            if cast:
                self.cast(unit)
            else:
                unit.bind(self.region_views(unit))
        self.prefetch_after(unit)

    def cast(self, unit: StreamUnit) -> None:
        """Bind a placed unit to its compute values: its fp8 weights cast from its stored bytes."""
        if not (unit.computed or unit.index in self.cast_bound):
            self._bind(unit, self.region(unit), self.region_views(unit))

    def ready(self, unit: StreamUnit) -> bool:
        """The unit's weights are bound to compute from now."""
        if unit.index in self.bound or unit.index in self.cast_bound:
            return True
        return unit.piece.resident is not None and (unit.cast is None or unit.computed)

    def _bind(self, unit: StreamUnit, region: torch.Tensor, views: list[torch.Tensor]) -> None:
        """Bind ``unit`` to ``views`` of its storage bytes ``region``, its fp8 weights to their
        compute values cast from there."""
        cast = unit.cast
        if cast is None:
            unit.bind(views)
            return
        buf, computed = self.casts.cast(unit.index, cast, region)
        self.cast_bound[unit.index] = buf
        unit.bind([*computed, *views[cast.count :]])

    def region(self, unit: StreamUnit) -> torch.Tensor:
        """The device bytes ``unit`` is bound to now: its kept buffer, or its ring buffer."""
        return unit.kept if unit.piece.resident is not None else self.bound[unit.index].buf

    def fix_cast(self, units: Iterable[StreamUnit]) -> None:
        """``units`` will be captured after their next eager forward: the cast buffer the capture
        casts into is fixed now (`CastPool.fix`), outside the capture and before that forward's
        own cast, which then uses it too (no second buffer is made)."""
        casts = [u.cast for u in units if u.cast is not None and not u.computed]
        if casts:
            self.casts.fix(casts[0].compute)

    def bind_captured(self, unit: StreamUnit) -> None:
        """In a capture (`block_graphs.py`): an fp8 unit's weights bound to values cast from its
        stored bytes into the fixed cast buffer, whose address every graph may bake in (the
        graphs replay one after another); where that cannot serve, into a buffer made inside the
        capture, from the graphs' pool. A unit held as compute values is bound to them already."""
        if unit.cast is None or unit.computed:
            return
        buf = self.casts.fixed_for(unit.cast)
        if buf is None:
            buf = torch.empty(unit.cast.nbytes, dtype=unit.cast.compute, device=self.device)
        views = compute_views(buf, unit.cast)
        cast_into(unit.cast, self.region(unit), buf, views)
        self._captured[unit.index] = buf
        unit.bind([*views, *self.region_views(unit)[unit.cast.count :]])

    def unbind_captured(self, unit: StreamUnit) -> None:
        """In a capture, a unit's forward ended: its stored bytes bound again, its buffer free for
        the next unit's cast in the same graph (a streamed unit is released next)."""
        if self._captured.pop(unit.index, None) is not None:
            unit.bind(self.region_views(unit))

    def region_views(self, unit: StreamUnit) -> list[torch.Tensor]:
        """``unit``'s tensors in `region`."""
        if unit.piece.resident is not None:
            return unit.kept_views
        return self.views(unit, self.bound[unit.index])

    def end_capture(self) -> None:
        """The captured call returned or raised: every unit still bound to a capture's cast is bound
        to its stored bytes again. Called inside the capture: under cudaMallocAsync a buffer made in
        a capture and freed after it is that graph's allocation freed from outside, which fails once
        its graph is gone or its memory unmapped (FLUX.2's third prompt aborted so: run 65)."""
        self.capturing = False
        for index in list(self._captured):
            self.unbind_captured(self.units[index])

    def release(self, *units: StreamUnit) -> bool:
        """The forward of ``units`` (one, or a block's bound together, in execution order) ended:
        back to their host copies (kept ones to their stored bytes), their buffers to the next
        streamed units, copied once all are free (one by one, the first would queue the next,
        still bound, again). True when that copy met an out-of-memory error (the unit then loads
        at its entry, where an OOM gives kept blocks up)."""
        freed = False
        for unit in units:
            self.uncast(unit)
            slot = self.bound.pop(unit.index, None)
            if slot is not None:
                unit.bind_host()
                self.ring.release(slot, read_by_compute=True)
                freed = True
        try:
            if freed:
                self.prefetch_after(units[-1])
        except torch.OutOfMemoryError:
            return True
        return False

    def uncast(self, unit: StreamUnit) -> None:
        """The unit's cast buffer back to the pool, its weights bound to their stored bytes."""
        buf = self.cast_bound.pop(unit.index, None)
        if buf is None:
            return
        self.casts.release(buf)
        if unit.kept_views is not None:
            unit.bind(unit.kept_views)

    def release_all(self) -> None:
        """Every bound unit back to its host copy (a forward that raised never released them)."""
        for index in list(self.cast_bound):
            self.uncast(self.units[index])
        for index in list(self.bound):
            self.units[index].bind_host()
            self.ring.release(self.bound.pop(index), read_by_compute=True)

    def prefetch_after(self, unit: StreamUnit | None, made_only: bool = False) -> None:
        """Keep exactly the next streamed units after ``unit`` (``None``: the forward's first)
        in flight that fill the ring's buffers with the one bound now, if any. Past the last
        block, the next forward's first ones, but one buffer fewer: that one is filled when the
        next forward begins. Why: where the host waits for each step's end (a progress bar, a
        preview), a ring filled across the boundary leaves the copy engine idle until the first
        streamed unit has run; a copy queued at the model's entry starts at once. ``made_only``:
        into the buffers the ring holds already (before a plan is settled, the room may be
        needed elsewhere)."""
        if self.copy_stream is None:
            return
        count = self.ring.capacity - len(self.bound)
        index = None if unit is None else unit.index
        upcoming = self.order.upcoming(index, count, next_forward=self.ring.capacity - 1)
        for index in list(self.inflight):
            if index not in upcoming:
                self.discard(index)  # a skipped branch, a changed plan
        for index in upcoming:
            if made_only and not self.ring.idle:
                break
            home = self.home(index)
            if index not in self.inflight and (home is None or self.ring.free_for(home, made_only)):
                self.inflight[index] = self._load(self.units[index])

    def home(self, index: int) -> int | None:
        """The ring buffer unit ``index`` is copied into (`ring.py` says why): its position among
        the forward's streamed units, modulo the buffers. A unit whose buffer is busy is copied
        once it comes back, after the units behind it: only across a forward's end, where a
        count of streamed units the buffers do not divide meets the next forward's first. None
        without a side stream: one unit is bound at a time, in one buffer."""
        rank = self.order.rank(index) if self.copy_stream is not None else None
        return None if rank is None else rank % self.ring.capacity

    def _drop_wrong_guesses(self, unit: StreamUnit) -> None:
        """``unit`` was not prefetched (a new plan, a skipped branch): the units in flight that
        will not run after it give their buffers back first, so it loads into one of them rather
        than into a buffer allocated beside them while the step's activations are live."""
        after = self.ring.capacity - 1 - len(self.bound)
        keep = set(self.order.upcoming(unit.index, after))
        for index in [i for i in self.inflight if i not in keep]:
            self.discard(index)

    def _take(self, unit: StreamUnit) -> RingSlot:
        slot = self.inflight.pop(unit.index, None)
        if slot is None:
            slot = self._load(unit)
        if slot.written is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.written)
        return slot

    def _load(self, unit: StreamUnit) -> RingSlot:
        """Copy a streamed unit into a ring slot, once the compute work that last read the
        slot is done (usually the unit that has just exited: the copy overlaps what runs next)."""
        slot = self.ring.acquire(self.home(unit.index))
        self.copied += unit.copy_bytes
        if self.staged(unit):
            slot.written = self.staging.copy(unit, slot.buf[: unit.nbytes], after=slot.read)
            return slot
        pairs = slot.pairs.get(unit.index)
        if pairs is None:
            pairs = slot.pairs[unit.index] = unit.copy_pairs(self.views(unit, slot), slot.buf[: unit.nbytes])
        slot.written = self.copy(pairs, unit.block.pinned, after=slot.read)
        return slot

    def staged(self, unit: StreamUnit) -> bool:
        """Whether ``unit`` is copied through the staging buffers: its host copy is not
        page-locked and there is a side stream to copy on."""
        if self.staging is None or unit.block.pinned:
            return False
        if not self.staging.slot_bytes:  # one size for every unit it stages
            self.staging.resize(max(u.nbytes for u in self.units))
        return True

    @staticmethod
    def views(unit: StreamUnit, slot: RingSlot) -> list[torch.Tensor]:
        """``unit``'s tensors in ``slot``'s buffer, made once per buffer and unit: a step uses
        them twice per streamed unit (copy, bind), and building them is most of the host time a
        streamed unit costs."""
        views = slot.views.get(unit.index)
        if views is None:
            views = slot.views[unit.index] = unit.views(slot.buf)
        return views

    def copy(self, pairs: Pairs, pinned: bool, after: torch.cuda.Event | None) -> torch.cuda.Event | None:
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

    def load_kept(self, piece: StreamPiece) -> torch.Tensor:
        """A kept piece's own buffer, its units bound to it (an fp8 unit's weights are cast
        from it at each bind). From the compute stream's pool: the copy waits for the compute
        work queued so far, which may still read that memory, and the compute stream for the copy."""
        buf = torch.empty(piece.nbytes, dtype=torch.uint8, device=self.device)
        self.copied += sum(unit.copy_bytes for unit in piece.units)
        compute = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        offset = 0
        for unit in piece.units:
            unit.kept = buf[offset : offset + unit.nbytes]
            unit.kept_views = unit.views(unit.kept)
            offset += unit.nbytes
        after = compute.record_event() if compute is not None else None
        if self.staged(piece.units[0]):
            ready = None
            for unit in piece.units:
                ready = self.staging.copy(unit, unit.kept, after=after)
        else:
            pairs = [pair for unit in piece.units for pair in unit.copy_pairs(unit.kept_views, unit.kept)]
            ready = self.copy(pairs, piece.block.pinned, after)
        if ready is not None:
            compute.wait_event(ready)
        for unit in piece.units:
            unit.bind(unit.kept_views)
        return buf

    def discard(self, index: int) -> None:
        """A unit copied ahead will not run next: its slot goes back to the ring unread."""
        self.ring.release(self.inflight.pop(index), read_by_compute=False)

    def drop_prefetched(self) -> None:
        """Forget the units copied ahead (stale after a write to the host copies) and give the
        idle ring buffers back to the allocator."""
        for index in list(self.inflight):
            self.discard(index)
        self.ring.clear()
        self.casts.clear()
        if self.staging is not None:
            self.staging.clear()

    def set_buffers(self, buffers: int) -> None:
        """How many streaming buffers circulate (units copied ahead beyond them are dropped)."""
        if buffers != self.ring.capacity:
            for index in list(self.inflight)[buffers - len(self.bound):]:
                self.discard(index)
            self.ring.set_capacity(buffers)

    def host_note(self, blocks: list[StreamBlock]) -> str:
        """How the blocks' host copies reach the device, for the streamer's log line."""
        pinned = sum(b.pinned for b in blocks)
        if pinned == len(blocks) > 0:
            return "pinned"
        rest = "through pinned staging buffers" if self.staging is not None else "synchronously from pageable memory"
        return f"{pinned}/{len(blocks)} blocks pinned, the rest copied {rest}"

    def host_details(self, blocks: list[StreamBlock]) -> dict[str, int]:
        """Host memory for the report: every block's master stays in RAM, kept or not."""
        staging = self.staging.details() if self.staging is not None else {"staging_bytes": 0, "staged": 0}
        return {"pinned_blocks": sum(b.pinned for b in blocks),
                "host_bytes": sum(s.nbytes for b in blocks for s in b.slots), **staging}

    def fill(self) -> bool:
        """With a side stream, make the ring's missing buffers now (see `BufferRing.fill`)."""
        return self.copy_stream is not None and self.ring.fill()

"""The streamed blocks' device buffers: a few flat buffers allocated once and reused block after
block, each with the events that say when it may be written and read.

Why not a fresh buffer per block from the caching allocator: a freed block buffer is split for
the activations allocated next, so the next block's buffer needs a new segment; under a video's
activations on a small card that churn leaves reserved memory no one can use, which the preload
would learn as shortages. Buffers that are never freed inside a run cannot be split.

Each buffer has a number (its ``home``, 0 to the capacity less one) and a streamed unit asks for
the one its position among the forward's streamed units gives (`Prefetcher.home`): a unit is in
the same buffer every forward, so the CUDA graph of a streamed unit, keyed by its buffer's address
(`block_graphs.py`), is captured once. Handed out as they came back, with N streamed units and R
buffers the units moved by N mod R buffers a forward and each needed R graphs, captured over 2R
forwards (bench/README.md, run 54).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class RingSlot:
    buf: torch.Tensor
    home: int = -1  # its number in the ring; -1: one allocated beyond the capacity
    written: torch.cuda.Event | None = None  # the last copy into it, on the side stream
    read: torch.cuda.Event | None = None  # the last compute work that may read it
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # per unit: its tensors in ``buf``
    pairs: dict[int, list] = field(default_factory=dict)  # per unit: its copy's (region, host) pairs


class BufferRing:
    """``capacity`` buffers of ``slot_bytes``, numbered. A slot taken while all are busy (a block
    that was not prefetched) is allocated beside them and freed when it comes back, so the ring
    never holds more than ``capacity`` between uses."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self.slot_bytes = 0
        self._free: list[RingSlot] = []
        self._busy = 0
        self._numbers: set[int] = set()  # the homes of the slots of this size, free and busy
        self.addresses: set[int] = set()  # the device addresses of every slot made and not dropped
        self._cuda = device.type == "cuda"

    @property
    def idle(self) -> int:
        """Buffers made and free."""
        return len(self._free)

    @property
    def nbytes(self) -> int:
        """Device bytes the ring holds, free and busy slots together."""
        return (len(self._free) + self._busy) * self.slot_bytes

    def set_capacity(self, capacity: int) -> None:
        """A new number of buffers (the plan's lookahead): free ones beyond it go now, busy ones
        when they come back."""
        self.capacity = capacity
        for slot in [s for s in self._free if s.home >= capacity]:  # busy ones when they come back
            self._free.remove(slot)
            self._drop(slot)

    def resize(self, slot_bytes: int) -> None:
        """The largest streamed block changed (a new resident set): free slots of the old size
        go now, busy ones when they come back."""
        if slot_bytes != self.slot_bytes:
            self.clear()
            self.slot_bytes = slot_bytes
            self._numbers = set()  # busy slots of the old size are dropped when they come back

    def fill(self) -> bool:
        """Allocate the missing buffers now, at a plan change between forwards, rather than at
        the first prefetch: there the step's activations are live, and a new buffer of another
        size (a video plan streams 283 MB feed-forwards where an image plan streamed 210 MB
        attentions) may find the cache fragmented, an allocator retry that the planner counts
        as a shortage. Best effort: what does not fit now is allocated when first needed. True
        when any buffer was made."""
        made = False
        while self.slot_bytes and len(self._free) + self._busy < self.capacity:
            try:
                self._free.append(self._make(self._unmade()[0]))
            except torch.OutOfMemoryError:
                break
            made = True
        return made

    def free_for(self, home: int, made_only: bool = False) -> bool:
        """Whether `acquire` would give buffer ``home``: it is free, or (unless ``made_only``) not
        made and there is room."""
        return any(slot.home == home for slot in self._free) or (
            not made_only and home in self._unmade() and len(self._free) + self._busy < self.capacity)

    def acquire(self, home: int | None = None) -> RingSlot:
        """A slot to copy a block into: buffer ``home`` where it is free (or made now), else any
        free one, else one allocated beside them. A new one is allocated from the compute stream's
        pool, whose queued work may still read that memory: its ``read`` event covers that work."""
        slot = next((s for s in self._free if s.home == home), None)
        if slot is not None:
            self._free.remove(slot)
        else:
            unmade = self._unmade() if len(self._free) + self._busy < self.capacity else []
            if home in unmade:
                slot = self._make(home)
            elif self._free:
                slot = self._free.pop()
            else:
                slot = self._make(unmade[0] if unmade else -1)
        self._busy += 1
        return slot

    def _unmade(self) -> list[int]:
        """The buffer numbers below the capacity no slot of this size has, free or busy."""
        return [n for n in range(self.capacity) if n not in self._numbers]

    def _make(self, home: int) -> RingSlot:
        buf = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
        self.addresses.add(buf.data_ptr())
        if home >= 0:
            self._numbers.add(home)
        return RingSlot(buf, home, read=self._record())

    def release(self, slot: RingSlot, read_by_compute: bool) -> None:
        """A slot is free again: after its block ran (``read_by_compute``), or unread (a
        dropped prefetch, whose copy may still be running: the next copy into it queues behind
        it on the same side stream)."""
        self._busy -= 1
        if read_by_compute:
            slot.read = self._record()
        if slot.buf.numel() == self.slot_bytes and 0 <= slot.home < self.capacity:  # one of the ring's numbers
            self._free.append(slot)
        else:
            self._drop(slot)

    def clear(self) -> None:
        """Give the free slots back to the allocator (end of a run, an OOM to relieve)."""
        while self._free:
            self._drop(self._free.pop())

    def _drop(self, slot: RingSlot) -> None:
        self.addresses.discard(slot.buf.data_ptr())
        if slot.buf.numel() == self.slot_bytes:
            self._numbers.discard(slot.home)
        # The pool hands freed memory out in compute-stream order: the compute stream waits for
        # a copy still running into it, or the next activation placed there is overwritten.
        if slot.written is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.written)

    def _record(self) -> torch.cuda.Event | None:
        return torch.cuda.current_stream(self.device).record_event() if self._cuda else None

"""The streamed blocks' device buffers: a few flat buffers allocated once and reused block after
block, each with the events that say when it may be written and read.

Why not a fresh buffer per block from the caching allocator: a freed block buffer is split for
the activations allocated next, so the next block's buffer needs a new segment; under a video's
activations on a small card that churn leaves reserved memory no one can use, which the preload
would learn as shortages. Buffers that are never freed inside a run cannot be split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class RingSlot:
    buf: torch.Tensor
    written: torch.cuda.Event | None = None  # the last copy into it, on the side stream
    read: torch.cuda.Event | None = None  # the last compute work that may read it
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # per unit: its tensors in ``buf``
    pairs: dict[int, list] = field(default_factory=dict)  # per unit: its copy's (region, host) pairs


class BufferRing:
    """``capacity`` buffers of ``slot_bytes``. A slot taken while all are busy (a block that was
    not prefetched) is allocated beside them and freed when it comes back, so the ring never
    holds more than ``capacity`` between uses."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self.slot_bytes = 0
        self._free: list[RingSlot] = []
        self._busy = 0
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
        while self._free and len(self._free) + self._busy > capacity:
            self._drop(self._free.pop())

    def resize(self, slot_bytes: int) -> None:
        """The largest streamed block changed (a new resident set): free slots of the old size
        go now, busy ones when they come back."""
        if slot_bytes != self.slot_bytes:
            self.clear()
            self.slot_bytes = slot_bytes

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
                buf = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError:
                break
            self._free.append(RingSlot(buf, read=self._record()))
            made = True
        return made

    def acquire(self) -> RingSlot:
        """A slot to copy a block into. A new one is allocated from the compute stream's pool,
        whose queued work may still read that memory: its ``read`` event covers that work."""
        self._busy += 1
        if self._free:
            return self._free.pop()
        try:
            buf = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
        except BaseException:
            self._busy -= 1
            raise
        return RingSlot(buf, read=self._record())

    def release(self, slot: RingSlot, read_by_compute: bool) -> None:
        """A slot is free again: after its block ran (``read_by_compute``), or unread (a
        dropped prefetch, whose copy may still be running: the next copy into it queues behind
        it on the same side stream)."""
        self._busy -= 1
        if read_by_compute:
            slot.read = self._record()
        if slot.buf.numel() == self.slot_bytes and len(self._free) + self._busy < self.capacity:
            self._free.append(slot)
        else:
            self._drop(slot)

    def clear(self) -> None:
        """Give the free slots back to the allocator (end of a run, an OOM to relieve)."""
        while self._free:
            self._drop(self._free.pop())

    def _drop(self, slot: RingSlot) -> None:
        # The pool hands freed memory out in compute-stream order: the compute stream waits for
        # a copy still running into it, or the next activation placed there is overwritten.
        if slot.written is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.written)

    def _record(self) -> torch.cuda.Event | None:
        return torch.cuda.current_stream(self.device).record_event() if self._cuda else None

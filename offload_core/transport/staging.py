"""Pinned staging buffers: how a streamed unit whose host copy is not page-locked still reaches
the device on the side stream.

A copy from pageable memory cannot run asynchronously (the driver stages it through its own
small pinned buffer, holding the host thread, and on the compute stream it stalls the compute).
Here the host copies the unit's bytes into one of a few pinned buffers of this ring (a memcpy,
spread over PyTorch's intra-op threads), then the side stream copies that buffer to the device
in one non-blocking copy; a staging buffer is written again only after the event of its last
device copy. Why on the calling thread, not a worker: the streaming ring's reuse rules rely on
each copy being queued on the side stream when ``_load`` returns; the host memcpy overlaps the
compute work already queued on the device, which is what the side stream is for.

The buffers are page-locked in place (`PinSet`, no rounding up); they are made at first use,
sized to the largest unit, and given back with the streamer's other buffers (end of a run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..pinning import PinSet
from .blocks import StreamUnit

STAGING_BUFFERS = 2  # the host fills one while the device copies from the other


@dataclass(eq=False)
class StagingBuffer:
    buf: torch.Tensor  # flat uint8 host bytes, page-locked where an accelerator is there
    done: torch.cuda.Event | None = None  # its last device copy, on the side stream
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # per unit: its tensors in ``buf``


class StagingRing:
    """``count`` pinned host buffers, used in turn. ``stream`` is the side stream the device
    copies run on; None copies at once (a device without streams: the same bytes, in order)."""

    def __init__(self, stream: torch.cuda.Stream | None, count: int = STAGING_BUFFERS) -> None:
        self.stream = stream
        self.count = count
        self.slot_bytes = 0
        self._buffers: list[StagingBuffer] = []
        self._next = 0
        self._pins = PinSet()
        self.staged = 0  # units copied through the ring (bench and tests read it)

    @property
    def nbytes(self) -> int:
        """Host bytes the ring holds (pinned where an accelerator is there)."""
        return sum(b.buf.numel() for b in self._buffers)

    def details(self) -> dict[str, int]:
        return {"staging_bytes": self.nbytes, "staged": self.staged}

    def resize(self, slot_bytes: int) -> None:
        """Buffers of at least ``slot_bytes`` from now on (the largest unit that may be staged)."""
        if slot_bytes > self.slot_bytes:
            self.clear()
            self.slot_bytes = slot_bytes

    def copy(self, unit: StreamUnit, dst: torch.Tensor, after: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """Copy ``unit``'s host masters into ``dst``, a flat device region of ``unit.nbytes`` laid
        out as `StreamUnit.views` says: on the side stream once ``after`` (the compute work that
        last read ``dst``) is done, returning the event that marks the copy done; at once without
        a stream (None)."""
        staging = self._take(unit.nbytes)
        views = staging.views.get(unit.index)
        if views is None:
            with torch.inference_mode(False):  # plain views: written in and out of inference mode
                views = staging.views[unit.index] = unit.views(staging.buf[: unit.nbytes])
        for view, slot in zip(views, unit.slots, strict=True):
            view.copy_(slot.host)
        src = staging.buf[: unit.nbytes]
        self.staged += 1
        if self.stream is None:
            dst.copy_(src)
            return None
        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            staging.done = self.stream.record_event()
        return staging.done

    def _take(self, nbytes: int) -> StagingBuffer:
        """The next buffer in turn, once its last device copy has read it (the host waits)."""
        self.resize(nbytes)
        if len(self._buffers) < self.count:
            with torch.inference_mode(False):  # a plain tensor: written in and out of inference mode
                buf = self._pins.pin(torch.empty(self.slot_bytes, dtype=torch.uint8))
            self._buffers.append(StagingBuffer(buf))
            return self._buffers[-1]
        staging = self._buffers[self._next]
        self._next = (self._next + 1) % len(self._buffers)
        if staging.done is not None:
            staging.done.synchronize()
            staging.done = None
        return staging

    def clear(self) -> None:
        """Give the buffers back (their device copies finished first), unpinned."""
        for staging in self._buffers:
            if staging.done is not None:
                staging.done.synchronize()
        self._buffers.clear()
        self._next = 0
        self._pins.release()

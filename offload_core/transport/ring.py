"""The streamed blocks' device memory: one flat buffer per run, handed out tensor by tensor as a
byte ring in execution order, with the events that say when each piece may be overwritten.

Why one buffer allocated once, not a fresh one per block: a freed 0.7 GB block buffer is split for
the activations allocated next, so the next block's buffer needs a new segment. Under a video's
activations on a 12 GiB card that churn left about 1.7 GiB reserved but unusable (run 8: 9.9 GiB
allocated at the peak, 11.6 GiB reserved). A buffer never freed inside a run cannot be split.

Why a byte ring, not slots the size of the largest unit: slots let the copies run ahead by whole
units only. With two slots of a part and three parts to a Wan block, the copies could not reach
past the next block's second part; its third was copied only once its first had run, while the
compute stream waited (run 12 at 24 GiB: 4.6 ms of wait per streamed block, 28 ms of a 97 ms
forward). Handed out by the tensor, the same bytes also take the first tensors of the unit that
does not fit whole.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

ALIGN = 512


@dataclass(eq=False)
class Piece:
    """Bytes ``[start, start + nbytes)`` of the ring, holding one tensor."""

    start: int
    nbytes: int
    done: bool = False  # no compute work will read it after what is queued now
    read: torch.cuda.Event | None = None  # that work's end, on the compute stream (None: never read)
    seq: int = 0  # release order


class ByteRing:
    """``capacity`` bytes handed out at a head that moves forward and wraps. A piece can be
    overwritten once it is done; pieces are taken in the order their units run, so those in the
    way of the head are always the oldest (a tensor that does not fit before the end starts
    over at 0, and the end left behind counts as in the way)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capacity = 0
        self.buf: torch.Tensor | None = None
        self.written: torch.cuda.Event | None = None  # the last copy into the buffer (side stream)
        self._live: deque[Piece] = deque()  # in the order taken: the oldest first
        self._head = 0
        self._seq = 0
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Device bytes the ring holds."""
        return self.capacity if self.buf is not None else 0

    def resize(self, capacity: int) -> bool:
        """A new largest streamed unit (a new resident set): the buffer goes and comes back at the
        new size on the next take. True when the size changed."""
        capacity = -(-capacity // ALIGN) * ALIGN
        if capacity == self.capacity:
            return False
        self.clear()
        self.capacity = capacity
        return True

    def take(self, nbytes: int) -> tuple[Piece, list[torch.cuda.Event]] | None:
        """A piece of ``nbytes`` at the head and the read events a copy into it must wait for;
        None while a piece in the way is not done (its unit runs now or is yet to run)."""
        size = max(-(-nbytes // ALIGN), 1) * ALIGN  # never empty: a piece's start is then below the head
        if size > self.capacity:
            return None
        if self.buf is None:
            self.buf = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        if not self._live:
            self._head = 0
        wrap = self._head + size > self.capacity
        start = 0 if wrap else self._head
        in_way = 0
        for piece in self._live:
            behind = piece.start >= self._head  # taken in the last lap, at or after the head
            if behind and not wrap and piece.start >= start + size:
                break
            if not behind and (not wrap or piece.start >= start + size):
                break
            if not piece.done:
                return None
            in_way += 1
        gone = [self._live.popleft() for _ in range(in_way)]
        newest = max((p for p in gone if p.read is not None), key=lambda p: p.seq, default=None)
        piece = Piece(start, size)
        self._live.append(piece)
        self._head = start + size
        return piece, [newest.read] if newest is not None else []

    def release(self, pieces: list[Piece], read: torch.cuda.Event | None) -> None:
        """``pieces`` may be overwritten after ``read`` (the compute work that read them; None: a
        copy never read, which the next copy into it queues behind on the same side stream)."""
        self._seq += 1
        for piece in pieces:
            piece.done, piece.read, piece.seq = True, read, self._seq

    def view(self, piece: Piece, like: torch.Tensor) -> torch.Tensor:
        """``piece`` seen as a tensor of ``like``'s dtype and shape (one op: the buffer is seen
        as each dtype once)."""
        typed = self._typed.get(like.dtype)
        if typed is None:
            typed = self._typed[like.dtype] = self.buf.view(like.dtype)
        return typed.as_strided(like.shape, _dense_strides(like.shape), piece.start // like.element_size())

    def clear(self) -> None:
        """Give the buffer back (end of a run, an OOM to relieve, a new size). Pieces still bound
        keep the old buffer alive through their views until they are unbound."""
        if self.buf is not None and self.written is not None:
            # The pool hands freed memory out in compute-stream order: the compute stream waits
            # for a copy still running into it, or the next activation placed there is overwritten.
            torch.cuda.current_stream(self.device).wait_event(self.written)
        self.buf, self.written = None, None
        self._typed.clear()
        self._live.clear()
        self._head = 0


def _dense_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))

"""The streamer's execution order: the units in the order a forward runs them, and which of them
are streamed now, answering "the next streamed units after this one".

Why an index: the hooks ask that question at every unit's entry and exit (hundreds of times a
forward). Scanning the order from the asking unit walks every kept unit in between, quadratic in
the unit count when most blocks are kept, on the launch path. The streamed units' positions are
kept sorted and a question is a bisection.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable


class ExecutionOrder:
    def __init__(self, units: list[int], streamed: Callable[[int], bool]) -> None:
        self._streamed_fn = streamed
        self.set(units)

    @property
    def units(self) -> list[int]:
        return self._units

    def set(self, units: list[int]) -> None:
        """A new order (learnt from a cycle, or guessed)."""
        self._units = list(units)
        self._pos = {u: p for p, u in enumerate(self._units)}
        self.refresh()

    def refresh(self) -> None:
        """Re-read which units stream (the resident set changed)."""
        self._positions = [p for p, u in enumerate(self._units) if self._streamed_fn(u)]
        self._ranks = {self._units[p]: r for r, p in enumerate(self._positions)}

    def rank(self, index: int) -> int | None:
        """The unit's position among the forward's streamed units (None: it is not one of them)."""
        return self._ranks.get(index)

    def first(self) -> int:
        return self._units[0]

    def sort(self, units: list) -> list:
        """``units`` (with an ``index``) in the order they run."""
        return sorted(units, key=lambda u: self._pos.get(u.index, len(self._pos)))

    def upcoming(self, index: int | None, count: int, next_forward: int | None = None) -> list[int]:
        """Up to ``count`` streamed units that run after ``index``, wrapping to the next forward
        (at most ``next_forward`` of them from there), ``index`` itself excluded (``None``, or a
        unit outside the order: from the order's start)."""
        streamed = self._positions
        if count <= 0 or not streamed:
            return []
        start = bisect_right(streamed, self._pos.get(index, -1))
        if next_forward is not None:
            count = min(count, len(streamed) - start + next_forward)
        out: list[int] = []
        for k in range(min(count, len(streamed))):
            unit = self._units[streamed[(start + k) % len(streamed)]]
            if unit == index:
                break
            out.append(unit)
        return out


class OrderLearner:
    """What a streamer learns its execution order from: ``seen``, the units the current forward
    has run, in order (kept ones too: a kept unit may stream under the next plan)."""

    def __init__(self, order: ExecutionOrder) -> None:
        self.order = order
        self.seen: list[int] = []
        self.guessed: set[str] = set()  # towers whose parts' order is still the registration order

    def learn(self) -> None:
        """``seen``'s order (unless under half ran) is the order to prefetch by; units a partial
        forward skipped (an interrupt, an unused tower) keep their known order after those it ran.
        A forward that ran the known order changes nothing (the usual case, met twice a forward:
        at its end and at the next one's first block, on the launch path)."""
        if self.seen == self.order.units:
            self.guessed.clear()
        elif self.seen and len(self.seen) >= len(self.order.units) // 2:
            ran = dict.fromkeys(self.seen)
            self.order.set([*ran, *(u for u in self.order.units if u not in ran)])
            self.guessed.clear()

    def learn_parts(self, units: list) -> bool:
        """First forward, a block entered after one that ran in parts: guess its tower's other
        blocks' parts in the order that one ran them (``units``: the streamer's unit table); True
        when the order changed (refill the prefetch). Parts are registered in one order and may
        run in another (H3's blocks compute their modulation, registered last, first): in the
        first forward every part was otherwise a missed prefetch that loaded synchronously (H3
        at full width: 0.76 s against 0.49 s whole)."""
        done = units[self.seen[-1]].block if self.seen else None  # none yet: a forward's first block
        if done is None or done.tower not in self.guessed:
            return False
        ran = [i - done.units[0].index for i in dict.fromkeys(i for i in self.seen if units[i].block is done)]
        if len(ran) != len(done.units):
            return False
        self.guessed.discard(done.tower)
        if ran == sorted(ran):
            return False
        like = [b for b in dict.fromkeys(u.block for u in units)
                if b.tower == done.tower and len(b.units) == len(done.units)]
        guess = {u.index: b.units[ran[k]].index for b in like for k, u in enumerate(b.units)}
        self.order.set([guess.get(i, i) for i in self.order.units])
        return True

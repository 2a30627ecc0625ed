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

    def first(self) -> int:
        return self._units[0]

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

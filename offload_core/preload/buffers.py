"""The streaming buffers a plan holds beside its kept pieces: how many, and their bytes.

Every buffer is the size of the largest unit a streamed piece moves (its slot), so their bytes
depend on which pieces the plan keeps. The count is the prefetch window's always (``base``), and
more, up to ``most``, where the fit leaves room (`lookahead_slots`): with most blocks kept, the
kept runs between streamed blocks outlast the copies two part-buffers hold, and the copy engine
idles. A shortage gives up the buffers beyond ``base`` before any kept piece.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from .fit import lookahead_slots


@dataclass
class StreamingBuffers:
    """``slot_sizes``: each piece's slot, by piece index; ``units``: the most units a streamed
    piece moves; ``count``: the buffers of the plan in force."""

    slot_sizes: dict[int, int]
    units: int
    whole: bool = False
    base: int = 2
    most: int = 2
    count: int = 2

    def set_window(self, prefetch_window: int, whole: bool) -> None:
        """``window + 1`` buffers always, up to a block ahead of the unit running where there is
        room. ``whole`` (a piece's units may be bound together: graphed or compiled): counted in
        pieces, the one bound and ``window`` more, since a piece bound whole frees its buffers
        only at its exit: with fewer, the next piece's copies wait for that exit."""
        self.whole = whole
        self.base = (prefetch_window + 1) * (self.units if whole else 1)
        self.most = max(self.base, prefetch_window + self.units)
        self.count = self.base

    def slot(self, resident: Collection[int]) -> int:
        """A buffer's size beside ``resident``: the largest streamed piece's slot (0: none streams)."""
        return max((s for i, s in self.slot_sizes.items() if i not in resident), default=0)

    def reserved(self, resident: Collection[int]) -> int:
        """Device bytes every plan keeping ``resident`` sets aside: the window's buffers."""
        return self.base * self.slot(resident)

    def held(self, resident: Collection[int]) -> int:
        """Device bytes the buffers of the plan in force take beside ``resident``."""
        return self.count * self.slot(resident)

    def beyond_base(self, resident: Collection[int]) -> int:
        """Bytes of the buffers beyond the window's: what a shortage gives up first (0: none)."""
        return max(0, self.count - self.base) * self.slot(resident)

    def for_room(self, kept: int, budget: int, resident: Collection[int]) -> int:
        """The buffers a plan keeping ``resident`` (``kept`` bytes) holds under ``budget``."""
        return lookahead_slots(kept, budget, self.slot(resident), self.base, self.most)

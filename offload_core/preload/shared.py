"""One device budget over the denoisers of one pipeline (Wan 2.2 A14B: ``transformer`` and
``transformer_2``, switched at the boundary timestep).

Each denoiser keeps its own planner (its measures, penalties and ranking stay its own); this
only decides who gives room up. While one denoiser runs, the others are idle: a plan that needs
room, or a shortage, takes their kept blocks (then their streaming buffers) first, in one request
of the whole need plus a margin (one reload of the starting plan, not one piece per retry), before
the running one's own plan shrinks. Pure logic over the members' two calls: it never touches the
device itself.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from ..log import get_logger
from .fit import MARGIN_BASE

log = get_logger("preload")

ROOM_MARGIN = MARGIN_BASE  # asked for beyond the need: allocator rounding, the next small growth


class Member(Protocol):
    """A denoiser's transport as the budget sees it (`PreloadingStreamer`)."""

    def givable_bytes(self) -> int: ...

    def give_back(self, nbytes: int) -> int: ...


class SharedBudget:
    """The denoisers of one pipeline, held weakly (the pipeline's state owns their transports)."""

    def __init__(self, members: list[tuple[str, Member]]) -> None:
        self._members = [(name, weakref.ref(member)) for name, member in members]

    def idle(self, running: Member) -> list[tuple[str, Member]]:
        """The other live members: idle while ``running`` runs."""
        live = [(name, m) for name, ref in self._members if (m := ref()) is not None]
        return [(name, m) for name, m in live if m is not running]

    def idle_room(self, running: Member) -> int:
        """Bytes the idle members could give back (their kept blocks, then their streaming
        buffers, which stay from run to run): room ``running``'s plan may count on."""
        return sum(m.givable_bytes() for _name, m in self.idle(running))

    def take_idle(self, running: Member, need: int, why: str) -> int:
        """Free ``need`` plus the margin from the idle members, each asked once for what is still
        missing (their lowest-ranked pieces go first, their buffers last); returns the bytes freed."""
        if need <= 0:
            return 0
        ask, freed = need + ROOM_MARGIN, 0
        for name, member in self.idle(running):
            if freed >= ask:
                break
            if member.givable_bytes():
                got = member.give_back(ask - freed)
                freed += got
                log.info("%s gave back %.2f GiB of kept blocks or buffers (%s: needed %.2f GiB + margin)",
                         name, got / 2**30, why, need / 2**30)
        return freed

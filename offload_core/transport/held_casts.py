"""Kept fp8 pieces held as compute values: with every block kept and room to spare, a kept
piece's fp8 units are cast once into a buffer of compute values that replaces its stored bytes
on the device, and its forwards (and their CUDA graphs) then run with no cast.

Why: with every block kept, the one cast per unit at each forward is all an fp8 step adds over a
compute-dtype resident step, and the room fp8 storage leaves on the card buys it back (bench/README.md,
run 32). A held piece takes its compute bytes instead of its stored bytes; its host master is
untouched, so letting it go is a copy from the host like any kept piece's. The preload driver
says how much room they may take (`PreloadDriver`); a shortage, an out-of-memory relief, a
give-back, a weight write and a plan that streams let them go first.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from ..log import get_logger
from .blocks import StoredDtypes, StreamPiece, StreamUnit
from .cast import cast_into, compute_views
from .prefetch import Prefetcher

log = get_logger("streamer")


def held_size(unit: StreamUnit) -> int:
    """The unit's bytes held as compute values: its fp8 region widened to the compute dtype."""
    return unit.nbytes + (unit.cast.compute_bytes - unit.cast.nbytes if unit.cast is not None else 0)


def extra_bytes(piece: StreamPiece) -> int:
    """What holding ``piece`` costs beyond keeping its stored bytes."""
    return sum(held_size(u) for u in piece.units) - piece.nbytes


class HeldCasts:
    """The pieces of one streamer held as compute values, in the order they were held."""

    def __init__(self, pieces: list[StreamPiece], prefetch: Prefetcher, stored: StoredDtypes) -> None:
        self.pieces = pieces  # the streamer's piece table
        self.prefetch = prefetch
        self.stored = stored  # told which weights are bound to compute values
        self.held: list[StreamPiece] = []
        self.castable: list[StreamPiece] = []  # pieces with fp8 units (`start`)
        self.step = 0  # the largest extra a castable piece costs: the smallest change `fit` makes
        self.model = ""

    def start(self, model: str) -> None:
        """The streamer's table is made (at apply): which pieces could be held, once."""
        self.model = model
        self.castable = [p for p in self.pieces if any(u.cast is not None for u in p.units)]
        self.step = max((extra_bytes(p) for p in self.castable), default=0)

    def stop(self) -> None:
        """The streamer is removed: every held piece back to its host master, none castable."""
        self.leaving(set())
        self.castable, self.step = [], 0

    @property
    def extra(self) -> int:
        return sum(extra_bytes(p) for p in self.held)

    def candidates(self) -> list[StreamPiece]:
        """Kept pieces with fp8 units, not held yet, in table order."""
        return [p for p in self.castable if p.resident is not None and p not in self.held]

    def fit(self, room: int) -> bool:
        """Hold pieces while their extra bytes fit ``room``, or let go of the last held until they
        do; a change smaller than the largest piece's extra is not made (a measure that moves by a
        little would otherwise re-cast, and re-capture the graphs, each forward). True on a change."""
        step, extra, changed = self.step, self.extra, False
        if extra - room > step:
            while self.held and self.extra > room:
                self._let_go(self.held[-1])
                changed = True
        elif room - extra >= 2 * step > 0:
            for piece in self.candidates():
                cost = extra_bytes(piece)
                if extra + cost > room:
                    break
                try:
                    self._hold(piece)
                except torch.OutOfMemoryError:
                    break
                extra += cost
                changed = True
        if changed:
            log.info("%s: %d of %d kept fp8 pieces held as compute values (+%.2f GiB)", self.model,
                     len(self.held), len(self.held) + len(self.candidates()), self.extra / 2**30)
        return changed

    def drop(self, keep: Collection[int] = ()) -> int:
        """Let every held piece go (back to its stored bytes) but those in ``keep`` (running now);
        returns the bytes freed."""
        freed = 0
        for piece in [p for p in reversed(self.held) if p.index not in keep]:
            freed += extra_bytes(piece)
            self._let_go(piece)
        return freed

    def leaving(self, kept: set[int]) -> None:
        """Pieces not in ``kept`` are leaving the device: no longer held, back to their host
        masters (a release would take a weight bound to another dtype for one the user cast)."""
        for piece in [p for p in self.held if p.index not in kept]:
            self.held.remove(piece)
            piece.bind_host()
            self._expect(piece, stored=True)

    def _hold(self, piece: StreamPiece) -> None:
        buf = torch.empty(sum(held_size(u) for u in piece.units), dtype=torch.uint8, device=piece.resident.device)
        offset, placed = 0, []
        for unit in piece.units:
            region = buf[offset : offset + held_size(unit)]
            placed.append((unit, region, self._fill(unit, region)))
            offset += region.numel()
        for unit, region, views in placed:
            unit.kept, unit.kept_views, unit.computed = region, views, unit.cast is not None
            unit.bind(views)
        piece.resident = buf
        self.held.append(piece)
        self._expect(piece, stored=False)

    @staticmethod
    def _fill(unit: StreamUnit, region: torch.Tensor) -> list[torch.Tensor]:
        """Write ``unit``'s held form into ``region`` from its kept bytes: its fp8 region cast,
        the rest copied after it; returns its tensors' views there."""
        cast = unit.cast
        if cast is None:
            region.copy_(unit.kept)
            return unit.views(region)
        values = region[: cast.compute_bytes].view(cast.compute)
        views = compute_views(values, cast)
        cast_into(cast, unit.kept, values, views)
        region[cast.compute_bytes :].copy_(unit.kept[cast.nbytes :])
        base = unit.start + cast.nbytes - cast.compute_bytes  # the rest's layout offset, moved past the values
        return [*views, *(slot.view(region, base) for slot in unit.slots[cast.count :])]

    def _let_go(self, piece: StreamPiece) -> None:
        self.held.remove(piece)
        piece.bind_host()
        piece.resident = self.prefetch.load_kept(piece)
        self._expect(piece, stored=True)

    def _expect(self, piece: StreamPiece, stored: bool) -> None:
        for unit in piece.units:
            if unit.cast is not None:
                tensors = [s.tensor for s in unit.slots[: unit.cast.count]]
                self.stored.expect(tensors, None if stored else unit.cast.compute)

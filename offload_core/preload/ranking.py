"""Preload order of a streamer's blocks: which blocks to keep resident first.

The planner keeps the longest prefix of this order that fits, so the order decides what a
partial preload buys:
- blocks that cannot be pinned come first of all: streaming them is the slowest (pageable
  copies, no overlap);
- then non-tower blocks (embeddings, heads, short stacks): small and touched every step;
- then tower blocks, each tower walked in a low-discrepancy order over its depth, so every
  prefix is spread over the stack and the streamed gaps between kept blocks stay short (the
  prefetch window then hides them better than one long streamed run);
- towers share ranks in proportion to their bytes: every prefix takes about the same fraction
  of each tower;
- of blocks streamed in parts, the planner sees two entries per block: its largest part (the
  core) and the rest. Every core ranks before any rest: a block whose whole does not fit the
  streaming buffers then streams only its rest, which does, instead of waiting on its own core
  (see `StreamPiece`).

A nested order cannot keep its *complements* even: at 34 of 40 kept, the streamed rest of a van
der Corput prefix sits 5, 5, 10, 5, 5, 10 apart, and long kept runs outlast what the streaming
buffers can copy ahead. So the ranking decides how many blocks of each tower stay, and
`spread_kept` then places a tower's streamed blocks evenly over its depth.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockInfo:
    """One entry of the streamer's block table, as the planner needs it."""

    index: int  # position in the streamer's block table; the planner speaks in these
    tower: str | None  # None: not part of a block stack (embedding, head, short stack)
    depth: int  # position within its tower (ignored when tower is None)
    nbytes: int
    pinnable: bool = True
    slot_bytes: int | None = None  # the largest piece it streams in (None: whole, ``nbytes``)
    units: int = 1  # the units (parts) it streams in
    core: bool = False  # the largest part of a block streamed in parts (ranks before the rests)


def rank_blocks(blocks: Sequence[BlockInfo]) -> list[int]:
    """Block indices in preload order (see the module docstring)."""
    unpinnable = [b for b in blocks if not b.pinnable]
    pinnable = [b for b in blocks if b.pinnable]
    return _rank_group(unpinnable) + _rank_group(pinnable)


def _rank_group(blocks: list[BlockInfo]) -> list[int]:
    ranked = [b.index for b in sorted(blocks, key=lambda b: b.index) if b.tower is None]
    for core in (True, False):
        towers = _towers([b for b in blocks if b.core == core])
        ranked += _interleave_towers([_spread(t) for t in towers.values()])
    return ranked


def _towers(blocks: Sequence[BlockInfo]) -> dict[str, list[BlockInfo]]:
    towers: dict[str, list[BlockInfo]] = {}
    for b in blocks:
        if b.tower is not None:
            towers.setdefault(b.tower, []).append(b)
    return towers


def _spread(tower: list[BlockInfo]) -> list[BlockInfo]:
    """The tower's blocks in van der Corput order over depth: each prefix of 2**k blocks sits
    on 2**k evenly spaced depths, and a prefix of any length is at most twice as coarse."""
    by_depth = sorted(tower, key=lambda b: b.depth)
    n = len(by_depth)
    size = 1 << max(n - 1, 0).bit_length()
    bits = size.bit_length() - 1
    order: list[int] = []
    seen: set[int] = set()
    for i in range(size):
        pos = _bit_reverse(i, bits) * n // size
        if pos not in seen:
            seen.add(pos)
            order.append(pos)
    return [by_depth[p] for p in order]


def _bit_reverse(value: int, bits: int) -> int:
    return int(format(value, f"0{bits}b")[::-1], 2) if bits else 0


def _interleave_towers(towers: list[list[BlockInfo]]) -> list[int]:
    """Merge spread towers so that each prefix takes the same byte fraction of every tower.

    A block's key is the fraction of its tower taken once it is half in (midpoint rule); ties
    go to the tower listed first.
    """
    keyed: list[tuple[float, int, int]] = []
    for t, tower in enumerate(towers):
        total = sum(b.nbytes for b in tower) or 1
        taken = 0
        for b in tower:
            keyed.append(((taken + b.nbytes / 2) / total, t, b.index))
            taken += b.nbytes
    return [index for _, _, index in sorted(keyed)]


def spread_kept(kept: frozenset[int], blocks: Sequence[BlockInfo]) -> frozenset[int]:
    """``kept`` with each tower's streamed blocks moved to even spacing over its depth, the
    count per tower unchanged (cores and rests apart). Only towers of pinnable blocks of one
    size are moved: there the bytes are the same, so the fit that chose ``kept`` still holds."""
    out = set(kept)
    for core in (True, False):
        for tower in _towers([b for b in blocks if b.core == core]).values():
            _spread_tower(tower, kept, out)
    return frozenset(out)


def _spread_tower(tower: list[BlockInfo], kept: frozenset[int], out: set[int]) -> None:
    if len({(b.nbytes, b.slot_bytes) for b in tower}) > 1 or not all(b.pinnable for b in tower):
        return
    by_depth = sorted(tower, key=lambda b: b.depth)
    n, streamed = len(by_depth), sum(b.index not in kept for b in by_depth)
    if 0 < streamed < n:
        # the first block streams: the previous forward's last kept run then hides its copy (streaming
        # the last instead made a synchronized step wait for the next forward's first copy: run 34)
        gaps = {j * n // streamed for j in range(streamed)}
        out -= {b.index for b in by_depth}
        out |= {b.index for d, b in enumerate(by_depth) if d not in gaps}


def shrink(resident: frozenset[int], ranking: Sequence[int], sizes: Mapping[int, int], nbytes: int) -> frozenset[int]:
    """``resident`` less its lowest-ranked blocks until it holds at most ``nbytes``."""
    out, held = set(resident), sum(sizes[i] for i in resident)
    for index in reversed(ranking):
        if held <= nbytes:
            break
        if index in out:
            out.discard(index)
            held -= sizes[index]
    return frozenset(out)


def lowest_first(resident: frozenset[int], ranking: Sequence[int], sizes: Mapping[int, int],
                 running: Collection[int], needed: int) -> frozenset[int]:
    """Blocks of ``resident`` to release, lowest-ranked first and none ``running``, until
    ``needed`` bytes (at least one block)."""
    released: list[int] = []
    freed = 0
    for index in reversed(ranking):
        if index in resident and index not in running:
            released.append(index)
            freed += sizes[index]
            if freed >= needed:
                break
    return frozenset(released)

"""The one line a change of plan prints (and the UI shows), and the block counts it reports."""

from __future__ import annotations

from collections.abc import Sequence

from .fit import GIB
from .ranking import BlockInfo


def block_counts(blocks: Sequence[BlockInfo], resident: frozenset[int]) -> tuple[int, int, int]:
    """(blocks kept whole, blocks kept in part, blocks): a block streamed in parts is two
    entries of the plan (its core and its rest)."""
    groups: dict[tuple, list[int]] = {}
    for b in blocks:
        groups.setdefault((b.tower, b.depth) if b.tower is not None else (None, b.index), []).append(b.index)
    held = [sum(i in resident for i in g) for g in groups.values()]
    whole = sum(h == len(g) for h, g in zip(held, groups.values(), strict=True))
    return whole, sum(h > 0 for h in held) - whole, len(groups)


def plan_line(
    *, kept: int, total: int, kept_bytes: int, peak: int | None, workload: int | None, penalty: int,
    buffers: int, partly: int = 0,
) -> str:
    """The plan in one line: blocks kept (whole, in part), their bytes, the activations, penalty, buffers."""
    if peak is not None:
        activations = f"activations measured {gb(peak)} (workload {workload})"
    elif workload is not None:
        activations = f"activations unmeasured (workload {workload})"
    else:
        activations = "activations unmeasured"
    part = f", {partly} in part" if partly else ""
    return (f"blocks kept {kept}/{total}{part} ({gb(kept_bytes)}), {activations}, penalty {gb(penalty)}, "
            f"{buffers} streaming buffers")


def gb(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"

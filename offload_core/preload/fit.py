"""The fit arithmetic: how many bytes of weights may stay resident beside the activations.

Pure functions over plain numbers, so every rule can be checked on hand-computed cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30
MARGIN_BASE = 512 * MIB  # allocator rounding, fragmentation, kernels' workspaces
MARGIN_FRACTION = 0.05  # of the measured peak: activations vary a little from step to step
GROWTH_FLOOR = 512 * MIB  # below this, growing the preload is not worth the transfer


@dataclass(frozen=True)
class MemoryReading:
    """What the memory reader returns, in bytes.

    free: the device's free memory (``torch.cuda.mem_get_info()[0]``).
    cached_unused: held by the caching allocator but not allocated
        (``memory_reserved() - memory_allocated()``): reusable by us.
    resident: bytes of this model's kept blocks and streaming buffers on the device now; the
        plan may reuse them, so they count as available although the device does not report
        them free (the non-block part, which stays whatever the plan, is not among them).
    opening: activations of the cycle that is starting, already allocated when it is read (the
        non-block part's outputs, at the first block): the measured peak counts them, so they
        count as available rather than twice against the plan.
    graphs: this model's CUDA graphs' memory now (their pool and static buffers; in none of the
        above), and ``graphs_on``: whether its calls may be captured (`graphs_to_come`).
    """

    free: int
    cached_unused: int
    resident: int
    opening: int = 0
    graphs: int = 0
    graphs_on: bool = False

    @property
    def available(self) -> int:
        return self.free + self.cached_unused + self.resident + self.opening


@dataclass(frozen=True)
class CycleUsage:
    """Allocator readings over one cycle, taken by the streamer."""

    peak: int  # max_memory_allocated() since the cycle began (peak stats reset at its start)
    weights_floor: int  # least bytes of this model's weights on the device during the cycle
    graphs: int | None = None  # its CUDA graphs' memory at its end; None: none of its block calls can be graphed

    @property
    def activations(self) -> int:
        return max(0, self.peak - self.weights_floor)


def margin(peak: int) -> int:
    return MARGIN_BASE + int(peak * MARGIN_FRACTION)


def weight_budget(reading: MemoryReading, peak: int, penalty: int, graphs: int = 0) -> int:
    """Bytes the resident weights plus the streaming slots may take: what is available less
    the measured activation peak, its margin, the penalty learnt from shortages and the
    memory CUDA graphs will still take (`graphs_to_come`)."""
    return reading.available - peak - margin(peak) - penalty - graphs


def graphs_to_come(reading: MemoryReading, expected: int | None, peak: int) -> int:
    """Bytes a workload's CUDA graphs will take beyond what they hold now: ``expected`` (the most
    they took for it; None: its calls are not graphed), at least its eager ``peak`` (a capture
    keeps a block's intermediates, and until every call is captured the eager ones still run
    beside them), once graphs are on. A plan made before the captures leaves them this room, so
    they neither run short nor shrink the plan a few steps into the run."""
    if not reading.graphs_on or expected is None:
        return 0
    return max(0, max(expected, peak) - reading.graphs)


def growth_threshold(largest_block: int) -> int:
    return max(GROWTH_FLOOR, 2 * largest_block)


def fit_prefix(sizes: Sequence[int], budget: int, slot_count: int, outside: int = 0,
               slot_sizes: Sequence[int] | None = None) -> int:
    """Length of the longest prefix of ``sizes`` that fits ``budget`` together with the slots
    the streamed blocks need (``slot_count`` times the largest slot a block left out needs:
    ``slot_sizes``, where a block streams in parts, else its size).

    ``outside`` is the largest slot needed whatever the prefix. The slots shrink as the prefix
    grows, so the total is not monotonic: every length is tried.
    """
    slots = sizes if slot_sizes is None else slot_sizes
    largest_after = [outside] * (len(sizes) + 1)
    for i in range(len(sizes) - 1, -1, -1):
        largest_after[i] = max(slots[i], largest_after[i + 1])
    best, kept = 0, 0
    for k in range(len(sizes) + 1):
        if kept + slot_count * largest_after[k] <= budget:
            best = k
        if k < len(sizes):
            kept += sizes[k]
    return best


def lookahead_slots(kept: int, budget: int, slot: int, base: int, most: int) -> int:
    """Streaming buffers beside ``kept`` bytes of resident blocks: ``base`` (the prefetch
    window's), plus as many more of ``slot`` bytes as the room the fit left under ``budget``
    holds, up to ``most``."""
    if slot <= 0:
        return base
    return max(base, min(most, (budget - kept) // slot))

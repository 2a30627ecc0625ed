"""Fit arithmetic on hand-computed cases, and the planner's use of it (prefix, hysteresis)."""

from dataclasses import dataclass

from diffusers_offload.offload_core.preload.fit import (
    GIB,
    MIB,
    MemoryReading,
    fit_prefix,
    graphs_to_come,
    growth_threshold,
    lookahead_slots,
    margin,
    weight_budget,
)
from diffusers_offload.offload_core.preload.measures import MeasureStore
from diffusers_offload.offload_core.preload.planner import CycleUsage, PreloadPlanner
from diffusers_offload.offload_core.preload.policy import parse_policy
from diffusers_offload.offload_core.preload.ranking import BlockInfo, spread_kept

PEAK = 2 * GIB
PEAK_MARGIN = 512 * MIB + 107_374_182  # 512 MiB + int(5 % of 2 GiB)


@dataclass
class Device:
    free: int
    cached_unused: int = 0
    resident: int = 0
    graphs: int = 0
    graphs_on: bool = False

    def __call__(self) -> MemoryReading:
        return MemoryReading(self.free, self.cached_unused, self.resident, graphs=self.graphs, graphs_on=self.graphs_on)


def free_for(budget: int) -> int:
    """Free bytes that leave ``budget`` for weights and slots beside PEAK."""
    return budget + PEAK + PEAK_MARGIN


BLOCKS = [BlockInfo(i, "t", i, GIB) for i in range(16)]


def planner_of_16(device: Device, prefetch_window: int = 1) -> PreloadPlanner:
    """16 tower blocks of 1 GiB, workload 100 measured at PEAK, loaded."""
    store = MeasureStore()
    planner = PreloadPlanner(BLOCKS, device, model_class="M", store=store, prefetch_window=prefetch_window)
    planner.on_load()
    planner.begin_cycle(100)
    planner.end_cycle(CycleUsage(peak=PEAK + 5 * GIB, weights_floor=5 * GIB))
    return planner


def test_margin_is_512_mib_plus_5_percent_of_the_peak():
    assert margin(0) == 512 * MIB
    assert margin(4 * GIB) == 512 * MIB + 214_748_364


def test_weight_budget_counts_cached_and_own_resident_bytes():
    reading = MemoryReading(free=10 * GIB, cached_unused=2 * GIB, resident=3 * GIB)
    # 15 available - 4 peak - (512 MiB + 5 % of 4 GiB) - 1 penalty
    assert weight_budget(reading, 4 * GIB, GIB) == 10 * GIB - 512 * MIB - 214_748_364
    assert weight_budget(reading, 4 * GIB, GIB, graphs=GIB) == 9 * GIB - 512 * MIB - 214_748_364


def test_graphs_to_come_are_the_most_they_took_or_the_eager_peak_less_what_they_hold():
    on = MemoryReading(free=10 * GIB, cached_unused=0, resident=0, graphs_on=True)
    assert graphs_to_come(on, None, GIB) == 0  # the workload's calls are not graphed
    assert graphs_to_come(on, 0, GIB) == GIB  # graphed, none captured yet: its eager peak
    assert graphs_to_come(on, 3 * GIB, GIB) == 3 * GIB
    held = MemoryReading(free=10 * GIB, cached_unused=0, resident=0, graphs=2 * GIB, graphs_on=True)
    assert graphs_to_come(held, 3 * GIB, GIB) == GIB
    assert graphs_to_come(held, GIB, GIB) == 0
    off = MemoryReading(free=10 * GIB, cached_unused=0, resident=0)
    assert graphs_to_come(off, 3 * GIB, GIB) == 0  # graphs off: none will be captured


def test_fit_prefix_counts_slots_for_the_largest_streamed_block():
    sizes = [1, 2, 2, 2, 2, 2]
    assert fit_prefix(sizes, budget=10, slot_count=2) == 3  # 5 kept + 2 x 2 slots = 9
    assert fit_prefix(sizes, budget=8, slot_count=2) == 2  # 3 + 4 = 7; 5 + 4 = 9 too much
    assert fit_prefix(sizes, budget=3, slot_count=2) == 0  # nothing fits: stream everything


def test_fit_prefix_keeps_everything_when_no_slot_is_needed():
    # 7 kept + 2 x 2 slots = 11 > 9, but all 9 kept need no slot at all
    assert fit_prefix([1, 2, 2, 2, 2], budget=9, slot_count=2) == 5


def test_fit_prefix_slots_include_blocks_outside_the_order():
    assert fit_prefix([1, 1], budget=6, slot_count=2, outside=3) == 0
    assert fit_prefix([1, 1], budget=8, slot_count=2, outside=3) == 2


def test_fit_prefix_slots_are_the_largest_part_of_a_block_streamed_in_parts():
    sizes = [1, 2, 2, 2, 2, 2]
    parts = [1, 1, 1, 1, 1, 1]  # each block streams in pieces of at most 1
    assert fit_prefix(sizes, budget=8, slot_count=2, slot_sizes=parts) == 3  # 5 kept + 2 x 1 = 7
    assert fit_prefix(sizes, budget=8, slot_count=2) == 2  # whole blocks: 2 x 2 slots


def test_growth_threshold_is_512_mib_or_two_blocks():
    assert growth_threshold(100 * MIB) == 512 * MIB
    assert growth_threshold(GIB) == 2 * GIB


def test_measured_workload_keeps_as_many_as_the_longest_fitting_ranked_prefix_spread():
    device = Device(free=free_for(10 * GIB))  # 8 blocks + 2 slots of 1 GiB
    planner = planner_of_16(device)
    assert planner.measured_peak(100) == PEAK
    assert planner.begin_cycle(100) == spread_kept(frozenset(planner.ranking[:8]), BLOCKS)


def test_prefetch_window_widens_the_slots():
    device = Device(free=free_for(10 * GIB))  # window 3: 4 slots, 6 blocks
    planner = planner_of_16(device, prefetch_window=3)
    assert len(planner.begin_cycle(100)) == 6


def test_own_resident_bytes_count_as_available():
    device = Device(free=free_for(10 * GIB))
    planner = planner_of_16(device)
    kept = planner.begin_cycle(100)
    device.free, device.resident = device.free - 8 * GIB, 8 * GIB  # what loading them costs
    assert planner.begin_cycle(100) == kept


def test_small_growth_is_skipped_and_large_growth_applied():
    device = Device(free=free_for(10 * GIB))
    planner = planner_of_16(device)
    planner.begin_cycle(100)
    device.free += GIB  # 9 would fit: 1 GiB more is under max(512 MiB, two blocks)
    assert len(planner.begin_cycle(100)) == 8
    device.free += GIB  # 10 fit: 2 GiB more is worth it, placed evenly
    assert planner.begin_cycle(100) == spread_kept(frozenset(planner.ranking[:10]), BLOCKS)


def test_a_shrink_for_the_last_cycles_workload_is_applied_and_spread_evenly():
    """The first plan after a measure is usually a shrink: its streamed blocks are spread evenly
    (9 of 16 streamed: never more than one kept block between two), not the lowest-ranked."""
    device = Device(free=free_for(10 * GIB))
    planner = planner_of_16(device)
    eight = planner.begin_cycle(100)
    device.free -= GIB // 4  # 7.75 GiB left for weights beside the 2 slots
    seven = planner.begin_cycle(100)
    released = eight - {max(eight, key=planner.ranking.index)}
    assert len(seven) == 7 and seven != released and seven == spread_kept(seven, BLOCKS)
    streamed = sorted(set(range(16)) - seven)
    assert max(b - a for a, b in zip(streamed, streamed[1:], strict=False)) <= 2
    assert planner.begin_cycle(100) == seven  # once even, it stays


def test_a_shrink_for_another_workload_only_releases():
    """Alternating workloads move no blocks to re-spread them: a shrink for a workload other than
    the last cycle's releases the lowest-ranked blocks only."""
    device = Device(free=free_for(10 * GIB))
    planner = planner_of_16(device)
    planner.begin_cycle(200)
    planner.end_cycle(CycleUsage(peak=PEAK + 5 * GIB, weights_floor=5 * GIB))  # measured as 100 was
    eight = planner.begin_cycle(100)
    device.free -= GIB // 4
    seven = planner.begin_cycle(200)
    assert len(eight) == 8 and eight - seven == {max(eight, key=planner.ranking.index)}


def test_unmeasured_workload_of_an_unmeasured_model_keeps_the_resident_set():
    device = Device(free=free_for(10 * GIB))
    planner = PreloadPlanner(BLOCKS, device, model_class="M", store=MeasureStore(), policy=4 * GIB)
    kept = planner.on_load()
    planner.policy = parse_policy("auto")
    device.free = 0
    assert kept and planner.begin_cycle(999) == kept


def test_unmeasured_workload_shrinks_to_an_estimate_scaled_from_a_smaller_one():
    device = Device(free=free_for(10 * GIB))
    planner = planner_of_16(device)
    kept = planner.begin_cycle(100)
    larger = planner.begin_cycle(300)  # estimated at 3x the activations of workload 100
    assert larger < kept
    assert planner.begin_cycle(50) <= kept  # a smaller workload borrows the larger measure: no growth


def test_a_new_prompt_length_is_estimated_from_the_nearest_smaller_measure_not_a_video():
    """MiniMax-H3 on the H200 (bench/README run 39): a new prompt a few tokens longer was estimated
    at the measure of a far larger workload (3.58 against 2.39 GiB), so its first step dropped a
    kept piece the next step took back. A workload at most 1/16 larger than a measured one is
    estimated from it, scaled by the square of the ratio."""
    device = Device(free=free_for(10 * GIB + GIB // 2))  # 8 blocks and 2 slots, and half a block
    planner = planner_of_16(device)
    planner.begin_cycle(1_000)
    planner.end_cycle(CycleUsage(peak=PEAK + 5 * GIB + 3 * GIB, weights_floor=5 * GIB))  # a larger workload: 5 GiB
    kept = planner.begin_cycle(100)
    assert len(kept) == 8
    assert planner.begin_cycle(105) == kept  # 2 GiB x 1.1025: the plan holds
    assert planner.measured_peak(105) is None and len(planner.begin_cycle(107)) < 8  # 1/16 is 6.25: from 1,000


def test_lookahead_slots_spend_the_room_left_up_to_the_most():
    assert lookahead_slots(kept=8 * GIB, budget=9 * GIB, slot=GIB // 4, base=2, most=5) == 4
    assert lookahead_slots(kept=8 * GIB, budget=10 * GIB, slot=GIB // 4, base=2, most=5) == 5
    assert lookahead_slots(kept=8 * GIB, budget=8 * GIB + GIB // 4, slot=GIB // 4, base=2, most=5) == 2
    assert lookahead_slots(kept=0, budget=9 * GIB, slot=0, base=2, most=5) == 2  # nothing streamed


def test_a_placement_with_another_window_rebinds_the_slots():
    device = Device(free=free_for(10 * GIB))
    planner = planner_of_16(device)  # the planner outlives the transport that made it
    planner.rebind(device, "auto", prefetch_window=3)
    assert len(planner.begin_cycle(100)) == 6


def test_a_graphed_workload_is_planned_with_its_graphs_room_before_they_are_captured():
    """Workload 100's block calls are graphed (its first cycle said so) and their graphs took
    3 GiB at most: before they are captured the plan leaves them that room, and once they hold
    it (out of the free memory) the plan is the same: nothing to shrink a few steps in."""
    device = Device(free=free_for(10 * GIB))
    store = MeasureStore()
    planner = PreloadPlanner(BLOCKS, device, model_class="M", store=store)
    planner.on_load()
    planner.begin_cycle(100)
    planner.end_cycle(CycleUsage(peak=PEAK, weights_floor=0, graphs=3 * GIB))
    assert len(planner.begin_cycle(100)) == 8  # graphs off (a CPU): 10 GiB = 8 kept + 2 slots
    device.graphs_on = True
    before = planner.begin_cycle(100)
    assert len(before) == 5  # 3 GiB left to the graphs to come
    device.free, device.graphs = device.free - 3 * GIB, 3 * GIB  # captured
    assert planner.begin_cycle(100) == before
    planner.end_cycle(CycleUsage(peak=PEAK, weights_floor=0, graphs=None))  # a cycle whose calls were not graphable
    assert store.graph_bytes(planner._key(100)) == 3 * GIB  # the most they took stays


def test_graphs_smaller_than_the_eager_peak_are_planned_at_the_eager_peak():
    """Until every call is captured the eager ones run beside the graphs: at least the eager peak."""
    device = Device(free=free_for(10 * GIB), graphs_on=True)
    planner = PreloadPlanner(BLOCKS, device, model_class="M", store=MeasureStore())
    planner.on_load()
    planner.begin_cycle(100)
    planner.end_cycle(CycleUsage(peak=PEAK, weights_floor=0, graphs=0))  # graphable, nothing captured yet
    assert len(planner.begin_cycle(100)) == 6  # 10 - 2 GiB: 6 kept + 2 slots

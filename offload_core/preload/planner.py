"""The preload planner: which of a streamer's blocks stay resident, decided once per cycle.

It owns the decisions only; the streamer owns the memory. It never touches the device: what it
knows of memory comes from the injected reader (``MemoryReading``) and from the cycle usage the
streamer passes (``CycleUsage``), so every rule can be driven by scripted numbers.

A planner lives as long as the model object (across unloads and reloads); see the package
docstring for the call sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from ..log import get_logger
from . import registry
from .buffers import StreamingBuffers
from .fit import (
    CycleUsage,
    MemoryReading,
    fit_prefix,
    graphs_to_come,
    growth_threshold,
    margin,
    weight_budget,
)
from .measures import MeasureKey, MeasureStore, process_store
from .penalty import Penalty
from .plan_line import block_counts, gb, plan_line
from .policy import Policy, parse_policy
from .ranking import BlockInfo, lowest_first, rank_blocks, shrink, spread_kept

logger = get_logger("preload")

MemoryReadingFn = Callable[[], MemoryReading]


@dataclass(frozen=True)
class Relief:
    """What a shortage gave up: resident blocks (for the streamer to evict), or the bytes of
    streaming buffers beyond the prefetch window's (the planner's ``ring_slots`` says how many
    remain). False when nothing could go."""

    blocks: frozenset[int] = frozenset()
    buffer_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.blocks) or self.buffer_bytes > 0


@dataclass
class _Cycle:
    workload: int
    stable: bool  # began with the resident set the cycle before ended with
    budget: int | None  # the weight budget it was planned with, before any penalty (auto, measured)
    shortage: bool = False


class PreloadPlanner:
    """Resident set of one model's streamed blocks: chosen at load and at each cycle's start,
    shrunk on shortage; and how many streaming buffers the streamer may fill ahead
    (``ring_slots``). ``blocks`` index the streamer's block table; ``model_class`` and
    ``identity`` (with the blocks' count and size) key the measures; ``prefetch_window`` is the
    streamer's, for the slots its streamed blocks need; ``whole``: a streamed block's parts may be
    bound together at its entry (its graph or compiled forward, `BlockStreamer._bind_whole`)."""

    def __init__(
        self,
        blocks: Sequence[BlockInfo],
        reader: MemoryReadingFn,
        *,
        model_class: str,
        identity: str = "",
        policy: Policy | str | int | float = "auto",
        prefetch_window: int = 1,
        whole: bool = False,
        store: MeasureStore | None = None,
        label: str | None = None,
    ) -> None:
        self.ranking: tuple[int, ...] = tuple(rank_blocks(blocks))
        self._blocks = tuple(blocks)
        self.policy = parse_policy(policy)
        self.label = label or model_class
        self.last_workload: int | None = None
        self.last_plan_line = ""
        self._sizes = {b.index: b.nbytes for b in blocks}
        self._largest = max(self._sizes.values(), default=0)
        self._reader = reader
        self.buffers = StreamingBuffers({b.index: b.slot_bytes or b.nbytes for b in blocks},
                                        max((b.units for b in blocks), default=1))
        self.buffers.set_window(prefetch_window, whole)
        self._store = process_store() if store is None else store
        self._model = (model_class, identity)
        self._resident: frozenset[int] = frozenset()
        self._kept: frozenset[int] = frozenset()  # resident set at the last unload
        self._evened: frozenset[int] = frozenset()  # the last set `_even` spread
        self._cycle: _Cycle | None = None
        self._loaded = False
        self._penalties: dict[int, Penalty] = {}
        self._planned: tuple | None = None  # (the last cycle's plan inputs, its plan)
        self._keys: dict[int, MeasureKey] = {}
        registry.register(self)

    def rebind(self, reader: MemoryReadingFn, policy: Policy | str | int | float, prefetch_window: int,
               whole: bool = False) -> None:
        """Attach the live transport's readings, policy and window: the planner outlives
        transports (it lives on the model), so a re-placement hands it fresh ones."""
        self._reader = reader
        self.policy = parse_policy(policy)
        self.buffers.set_window(prefetch_window, whole)

    def unbind(self) -> None:
        """The transport is gone: drop its reading (its driver's method, which holds the streamer
        and with it the kept blocks and buffers on the device), so that the planner the model keeps
        holds its measures only and a release frees the device without a garbage collection."""
        self._reader = _unplaced

    @property
    def ring_slots(self) -> int:
        """The streaming buffers of the plan in force (`StreamingBuffers`)."""
        return self.buffers.count

    @property
    def resident(self) -> frozenset[int]:
        return self._resident

    @property
    def cycle_open(self) -> bool:
        return self._cycle is not None

    def on_load(self) -> frozenset[int]:
        """The model is being placed on the device: the blocks to load resident with it.

        Auto: the blocks kept at the last unload, as far as they fit beside the last workload's
        measure. Fixed: the ranked prefix up to the budget (undoing earlier shortage releases).
        """
        registry.notify_model_load()
        self._loaded = True
        self._resident = self._load_set()
        self.buffers.count = self._ring_for(self._resident, self.last_workload)
        self._log_plan(self.last_workload)
        return self._resident

    def on_unload(self) -> None:
        """The model's weights left the device; the resident set is remembered for reload."""
        self.end_cycle()
        self._kept, self._resident = self._resident, frozenset()
        self._loaded = False

    def begin_cycle(self, workload: int, ended: CycleUsage | None = None,
                    reading: MemoryReading | None = None) -> frozenset[int]:
        """The first block of the first tower is entered: close the open cycle with ``ended``
        (its usage), end other models' cycles, and return the resident set for this cycle.
        ``reading``: the device's now (None: read here); one serves the fit, the buffers and the
        budget, and a cycle that starts as the last one did keeps its plan unworked: a
        synchronized step's first block waits for this."""
        if not self._loaded:
            raise RuntimeError(f"{self.label}: begin_cycle before on_load")
        self.end_cycle(ended)
        registry.close_cycles(keep=self)
        reading = reading or self._reader()
        inputs = self._plan_inputs(workload, reading)
        if self._planned is not None and self._planned[0] == inputs:
            target, slots, budget = self._planned[1]
        else:
            target = self._cycle_target(workload, reading=reading)
            slots = self._ring_for(target, workload, reading)
            budget = self._budget_before_penalty(workload, reading)
        stable = target == self._resident
        self.last_workload = workload
        if not stable or slots != self.buffers.count:
            self._resident, self.buffers.count = target, slots
            self._log_plan(workload)
        self._planned = (inputs, (target, slots, budget))
        self._cycle = _Cycle(workload, stable, budget)
        return target

    def _plan_inputs(self, workload: int, reading: MemoryReading) -> tuple:
        """Everything a cycle's plan is worked from: equal ones give the same plan."""
        peak = self.measured_peak(workload)
        guess = self._store.estimate(self._key(workload)) if peak is None else None
        return (workload, reading, self._resident, self.last_workload, self._evened, self.policy, self.buffers.base,
                self.buffers.most, peak, guess, self.penalty(workload), self._store.graph_bytes(self._key(workload)))

    def _budget_before_penalty(self, workload: int, reading: MemoryReading) -> int | None:
        """The weight budget a cycle plans with, less no penalty (auto, measured): what a shortage compares (`_learn`)."""
        peak = self.measured_peak(workload)
        return None if self.policy.mode != "auto" or peak is None else self._budget(workload, peak, reading, 0)

    def preview(self, workload: int) -> frozenset[int]:
        """The resident set a cycle of ``workload`` would start with, changing nothing."""
        return self._cycle_target(workload)

    def room_wanted(self, workload: int | None, extra: int) -> int:
        """Bytes the device lacks now for the plan a cycle of ``workload`` would choose if
        ``extra`` more bytes were free (what idle denoisers could give back, `shared.py`): what to
        ask them for. 0 when that plan fits already, or nothing is measured or estimated (auto only)."""
        if self.policy.mode != "auto" or workload is None or extra <= 0:
            return 0
        peak = self.measured_peak(workload)
        peak = self._store.estimate(self._key(workload)) if peak is None else peak
        if peak is None:
            return 0
        reading = self._reader()
        needs = self._footprint(self._cycle_target(workload, extra, reading))
        return max(0, needs - self._budget(workload, peak, reading))

    def spare(self, workload: int) -> int:
        """Bytes the plan for ``workload`` leaves unused beside its kept blocks and streaming
        buffers (auto with a measure; else 0): what pieces held as compute values may take."""
        peak = self.measured_peak(workload)
        if self.policy.mode != "auto" or peak is None:
            return 0
        return max(0, self._budget(workload, peak, self._reader()) - self._footprint(self._resident))

    def _footprint(self, resident: frozenset[int]) -> int:
        """Device bytes a plan keeping ``resident`` takes: those blocks and the window's streaming slots."""
        return self._bytes(resident) + self.buffers.reserved(resident)

    def end_cycle(self, usage: CycleUsage | None = None) -> None:
        """Close the open cycle, if any. Its measure is recorded only with ``usage`` and when
        its resident set held still and it saw no shortage; without ``usage`` (another model
        took over, unload) nothing is measured."""
        cycle, self._cycle = self._cycle, None
        if cycle is None:
            return
        if usage is not None and cycle.stable and not cycle.shortage:
            self._store.record(self._key(cycle.workload), usage.activations)
        if usage is not None and usage.graphs is not None:
            self._store.record_graphs(self._key(cycle.workload), usage.graphs)
        if cycle.workload in self._penalties or self.penalty(cycle.workload):  # learnt here or stored
            penalty = self._penalty_of(cycle.workload)
            penalty.close_cycle(clean=not cycle.shortage)
            self._store.record_penalty(self._key(cycle.workload), penalty.bytes)

    def on_shortage(self, running: Collection[int] = (), needed: int = 0) -> Relief:
        """An allocation failed or the allocator had to free its cache and retry. The streaming
        buffers the lookahead added beyond the window's go first: they bought speed only with
        the fit's spare room, and a kept block saves a transfer every step. Without them:
        resident blocks, lowest-ranked first and never those ``running``, until ``needed`` bytes
        (at least one block). The workload's penalty learns from it (`_learn`). An empty
        answer means nothing can go: a true out-of-memory."""
        planned = self._plan_bytes()
        relief = self._release_buffers()
        if not relief:
            relief = Relief(blocks=lowest_first(self._resident, self.ranking, self._sizes, running, needed))
        if not relief:
            return relief
        self._resident -= relief.blocks
        self.buffers.count = self.buffers.base
        if self._cycle is not None:
            self._cycle.shortage = True
        if self.policy.mode == "auto" and self.last_workload is not None:
            self._learn(planned, needed, relief.buffer_bytes + self._bytes(relief.blocks))
        self._log_plan(self.last_workload)
        return relief

    def _learn(self, planned: int, needed: int, released: int) -> None:
        """A plan of ``planned`` device bytes ran short and ``released`` went (`Penalty.learn`)."""
        penalty = self._penalty_of(self.last_workload)
        penalty.learn(planned, needed, released, self._cycle.budget if self._cycle is not None else None)
        self._store.record_penalty(self._key(self.last_workload), penalty.bytes)

    def _plan_bytes(self) -> int:
        """Device bytes the plan takes now: its kept blocks and all its streaming buffers."""
        return self._bytes(self._resident) + self.buffers.held(self._resident)

    def _release_buffers(self) -> Relief:
        """The lookahead's buffers beyond the window's, as a relief (empty when there are none)."""
        return Relief(buffer_bytes=self.buffers.beyond_base(self._resident))

    def penalty(self, workload: int | None) -> int:
        if workload is None:
            return 0
        found = self._penalties.get(workload)
        return found.bytes if found is not None else self._store.penalty(self._key(workload))

    def _penalty_of(self, workload: int) -> Penalty:
        """The workload's penalty state, starting from the stored bytes (an earlier planner or
        process learnt them)."""
        if workload not in self._penalties:
            self._penalties[workload] = Penalty(bytes=self._store.penalty(self._key(workload)))
        return self._penalties[workload]

    def measured_peak(self, workload: int | None) -> int | None:
        return None if workload is None else self._store.get(self._key(workload))

    def _load_set(self) -> frozenset[int]:
        if self.policy.mode == "off":
            return frozenset()
        if self.policy.mode == "fixed":
            sizes = [self._sizes[i] for i in self.ranking]
            return spread_kept(frozenset(self.ranking[: fit_prefix(sizes, self.policy.budget, 0)]), self._blocks)
        kept = [i for i in self.ranking if i in self._kept]
        return self._fit(kept, self.measured_peak(self.last_workload) or 0, self.last_workload)

    def _cycle_target(self, workload: int, extra: int = 0, reading: MemoryReading | None = None) -> frozenset[int]:
        """Auto with a measure: the fitted prefix's blocks per tower, spread evenly, unless it
        grows by too little to be worth the transfer; a shrink releases (lowest-ranked first),
        and a set kept or shrunk for the workload the last cycle ran is spread evenly too
        (`_even`). Unmeasured: the set already resident, shrunk to what fits beside an estimate
        from the model's other workloads (so a first video step after images does not run out of
        memory). Off and fixed: the set already resident. ``extra``: bytes assumed free beyond
        the reading (`room_wanted`), ``reading`` the device's (None: read now)."""
        if self.policy.mode != "auto":
            return self._resident
        peak = self.measured_peak(workload)
        if peak is None:
            guess = self._store.estimate(self._key(workload))
            if guess is None:
                return self._resident
            fitted = self._fit(self.ranking, guess, workload, extra, reading)
            return shrink(self._resident, self.ranking, self._sizes, self._bytes(fitted))
        fitted = self._fit(self.ranking, peak, workload, extra, reading)
        growth = self._bytes(fitted) - self._bytes(self._resident)
        if growth >= growth_threshold(self._largest):
            return spread_kept(fitted, self._blocks)
        shrunk = shrink(self._resident, self.ranking, self._sizes, self._bytes(fitted))
        return self._even(shrunk if growth < 0 else self._resident, workload)

    def _even(self, target: frozenset[int], workload: int) -> frozenset[int]:
        """``target`` with its streamed blocks spread evenly (`spread_kept`) when the workload is
        the last cycle's: two streamed blocks side by side leave one block's compute to hide
        the second's copy (the first plan after a measure is a shrink of the unmeasured one, its
        streamed blocks the lowest-ranked, often side by side). Another workload's set only
        releases, so alternating image and video cycles move no blocks to re-spread them."""
        if workload != self.last_workload or target == self._evened:
            return target
        self._evened = spread_kept(target, self._blocks)
        return self._evened

    def _fit(self, order: Sequence[int], peak: int, workload: int | None, extra: int = 0,
             reading: MemoryReading | None = None) -> frozenset[int]:
        """The longest prefix of ``order`` that fits beside ``peak`` and the penalty (with
        ``extra`` bytes more than the reading's)."""
        reading, penalty = reading or self._reader(), self.penalty(workload)
        budget = self._budget(workload, peak, reading, penalty) + extra
        graphs = weight_budget(reading, peak, penalty) + extra - budget
        chosen = set(order)
        outside = max((s for i, s in self.buffers.slot_sizes.items() if i not in chosen), default=0)
        k = fit_prefix([self._sizes[i] for i in order], budget, self.buffers.base, outside,
                       [self.buffers.slot_sizes[i] for i in order])
        logger.debug("%s: fit: free %s + cached %s + ours %s - activations %s - margin %s - penalty %s - graphs "
                     "to come %s = %s: %d of %d", self.label, *map(gb, (reading.free, reading.cached_unused,
                     reading.resident, peak, margin(peak), penalty, graphs, budget)), k, len(order))
        return frozenset(order[:k])

    def _ring_for(self, resident: frozenset[int], workload: int | None, reading: MemoryReading | None = None) -> int:
        """Streaming buffers beside ``resident``: the window's, and more where the fit left room
        (auto, measured; `StreamingBuffers.for_room`)."""
        peak = self.measured_peak(workload)
        if self.policy.mode != "auto" or peak is None:
            return self.buffers.base
        budget = self._budget(workload, peak, reading or self._reader())
        return self.buffers.for_room(self._bytes(resident), budget, resident)

    def _budget(self, workload: int | None, peak: int, reading: MemoryReading, penalty: int | None = None) -> int:
        """`weight_budget` for ``workload`` (``penalty`` None: its own), less the room its CUDA graphs
        will still take (`graphs_to_come`: from the most they took for it)."""
        penalty = self.penalty(workload) if penalty is None else penalty
        expected = None if workload is None else self._store.graph_bytes(self._key(workload))
        return weight_budget(reading, peak, penalty, graphs_to_come(reading, expected, peak))

    def _bytes(self, blocks: frozenset[int]) -> int:
        return sum(self._sizes[i] for i in blocks)

    def _key(self, workload: int) -> MeasureKey:
        key = self._keys.get(workload)
        if key is None:
            model_class, identity = self._model
            key = self._keys[workload] = MeasureKey(model_class, identity, len(self._sizes), sum(self._sizes.values()),
                                                    workload)
        return key

    def _log_plan(self, workload: int | None) -> None:
        whole, partly, total = block_counts(self._blocks, self._resident)
        self.last_plan_line = plan_line(
            kept=whole, partly=partly, total=total, kept_bytes=self._bytes(self._resident),
            peak=self.measured_peak(workload), workload=workload, penalty=self.penalty(workload),
            buffers=self.buffers.count)
        logger.info("%s: %s", self.label, self.last_plan_line)


def _unplaced() -> MemoryReading:
    raise RuntimeError("the preload planner was asked for a reading with no placement (rebind it first)")

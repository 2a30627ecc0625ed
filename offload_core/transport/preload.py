"""Drives a `PreloadPlanner` from a `BlockStreamer`: readings in, resident sets out.

The planner is kept on the denoiser module itself, so it outlives a transport teardown: measures,
penalties and the blocks kept at unload survive a release and come back with the next placement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from ..config import OffloadConfig
from ..log import get_logger
from ..memory import MemoryReader, prefer_expandable_segments
from ..preload import BlockInfo, CycleUsage, MemoryReading, Policy, PreloadPlanner
from ..preload.shared import SharedBudget
from ..preload.workload import entry_signature, scaled_workload, workload_fn
from ..state import PLANNER
from .graph_worth import GraphWorth
from .held_casts import HeldCasts
from .streamer import BlockStreamer

logger = get_logger("preload")


class PreloadingStreamer(BlockStreamer):
    """The per-step transport: a block streamer whose resident set a planner chooses."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.driver: PreloadDriver | None = None
        self.worth: GraphWorth | None = None  # whether each workload's graphs pay for their memory
        self.held = HeldCasts(self.pieces, self.prefetch, self.stored)  # fp8 pieces kept as compute values

    def apply(self, module: torch.nn.Module) -> None:
        prefer_expandable_segments(self.device)  # before the first segment of this model is made
        super().apply(module)
        self.held.start(type(module).__name__)
        self.driver = PreloadDriver(self, module, self.ctx.memory, self.ctx.config.preload)
        self.worth = GraphWorth(self, self._graphs_on) if self.cuda and self.graphed else None
        self.driver.load()

    def _graphs_on(self, on: bool) -> None:
        """Graphs on or off for the coming workload (`graph_worth.py`); the plan's buffers follow
        whether a streaming block's parts are then bound whole."""
        self.graphs.enable(on)
        planner = self.driver.planner if self.driver is not None else None
        if planner is not None and self.binds_whole != planner.buffers.whole:
            planner.buffers.set_window(self.ctx.prefetch_window, self.binds_whole)

    @property
    def binds_whole(self) -> bool:
        """A streaming block in parts may be bound whole (`_bind_whole`): its call graphed or its forward compiled."""
        return self.graphs.cache.enabled or self.compiled.enabled

    def retune(self, config: OffloadConfig) -> None:
        """A new preload policy on a placed model: re-planned in place, no re-hooking."""
        super().retune(config)
        planner = self.driver.planner if self.driver is not None else None
        if planner is not None and (config.preload != planner.policy or self.binds_whole != planner.buffers.whole):
            planner.rebind(self.driver.reading, config.preload, self.ctx.prefetch_window, self.binds_whole)
            self.driver.load()

    def remove(self, module: torch.nn.Module) -> None:
        driver, self.driver = self.driver, None
        try:
            if driver is not None:
                driver.unload()
        finally:
            if driver is not None:
                driver.planner.unbind()
            self.events.unsubscribe(PreloadDriver.NAME)
            self.events.unsubscribe(GraphWorth.NAME)
            self.held.stop()
            super().remove(module)

    def share(self, budget: SharedBudget | None) -> None:
        """Join the pipeline's budget over its denoisers (None: the only one)."""
        if self.driver is not None:
            self.driver.shared = budget

    def set_resident(self, indices: set[int]) -> None:
        self.held.leaving(indices)
        super().set_resident(indices)

    def before_write(self) -> None:  # held compute values would not see the write
        self.held.drop()
        super().before_write()

    def give_back_kept(self, nbytes: int) -> int:
        """Let the pieces held as compute values go, then release kept pieces, lowest-ranked first;
        the planner keeps its plan, so they come back at the next cycle where they fit."""
        freed = self.held.drop()
        return freed if freed >= nbytes else freed + super().give_back_kept(nbytes - freed)

    def release_order(self) -> Iterable[int]:
        """The planner's ranking, lowest first: what is left is still the best set of its size."""
        return reversed(self.driver.planner.ranking) if self.driver is not None else super().release_order()

    def run_bytes(self) -> int:
        """The streaming slots plus the activations measured for the last workload."""
        planner = self.driver.planner if self.driver is not None else None
        measured = planner.measured_peak(planner.last_workload) if planner is not None else None
        return super().run_bytes() + (measured or 0)

    def details(self) -> dict[str, object]:
        out = super().details()
        out["plan"] = self.driver.planner.last_plan_line if self.driver is not None else ""
        out["held_bytes"] = self.held.extra
        out["graphs_aside"] = int(self.worth is not None and self.worth.aside())
        return out


class PreloadDriver:
    NAME = "preload"

    def __init__(self, streamer: PreloadingStreamer, module: torch.nn.Module, memory: MemoryReader,
                 policy: Policy) -> None:
        self.streamer = streamer
        self.memory = memory
        self.planner = _planner_for(module, streamer, self.reading, policy)
        self._retries = memory.allocator_retries(streamer.device)
        self._others = 0  # device bytes held by others (other models, a ballast) at forward start
        self._entering = False  # a forward has started and its first block not yet
        self._entry: tuple = ()  # the shapes this forward entered with
        self._workload_by_entry: dict[tuple, int] = {}
        self._last: tuple[tuple, int] | None = None  # (entry, workload) of the last cycle
        self.shared: SharedBudget | None = None  # the other denoisers of the pipeline (`share`)
        self._peak_before = 0  # this cycle's own peak before its CUDA graph captures (theirs is not activations)
        self._before_capture = 0  # bytes allocated when the last capture began
        self._described = 0  # the graph cache's graphable calls when the cycle began
        self._hold = True  # pieces may be held as compute values (not after a shortage, until the run ends)
        self._plan_s = self._capture_s = 0.0  # this forward's host seconds in its plan and its captures (DEBUG)
        self._captures, self._capture_began = 0, 0.0
        self._launched = (0, 0.0)  # the graphs' first launches and their host s before this forward
        streamer.events.subscribe(self.NAME, self.on_event)

    def reading(self) -> MemoryReading:
        """The room a plan may use: the device's free and cached memory plus this model's kept
        blocks and streaming buffers, which a plan reuses; not the non-block part, which stays
        (counting it would over-commit by its size), nor the cached memory of CUDA graphs' pools,
        which only they use (`memory.set_apart`; this model's graphs' memory is read apart:
        `graphs_to_come`)."""
        graphs = self.streamer.graphs
        with self.memory.one_reading():
            free, cached = self.memory.device_free(self.streamer.device)
            ours = self.streamer.device_bytes()
            return MemoryReading(free=free, cached_unused=cached, resident=max(ours - self.streamer.head_bytes(), 0),
                                 opening=self._opening(ours), graphs=graphs.nbytes, graphs_on=graphs.cache.on)

    def _opening(self, ours: int) -> int:
        """Between a forward's start and its first block: what the forward has allocated so far
        beyond what others held at its start (``ours``: this model's device bytes)."""
        if not self._entering:
            return 0
        return max(0, self.memory.allocated(self.streamer.device) - ours - self._others)

    def load(self) -> None:
        self._apply(self.planner.on_load())

    def unload(self) -> None:
        self.planner.on_unload()

    def _usage(self) -> CycleUsage | None:
        """This model's own peak: the process-wide allocator peak (outside graph captures) less
        what others held when the cycle began (their weights are not our activations); and its
        CUDA graphs' memory where a block call of this cycle could be graphed, with what one waits
        for to launch (the next plan leaves it room)."""
        peak = self.memory.peak_allocated(self.streamer.device)
        if peak is None:
            return None
        graphs = self.streamer.graphs
        graphed = graphs.cache.on and graphs.cache.described > self._described
        return CycleUsage(peak=max(peak - self._others, self._peak_before), weights_floor=self.streamer.weights_at_peak(),
                          graphs=graphs.wanted if graphed else None)

    def _forward_begins(self, args: tuple, kwargs: dict) -> None:
        """Before the denoiser's own first allocation: give up now the blocks the coming
        workload's plan drops (its inputs are made before the first block, where its cycle
        begins: on a tight card the non-block part would otherwise run out of memory, and cuDNN
        would pick, and keep for the process, another convolution algorithm for it), and take what
        others hold, and the allocator's retries so far, as the baselines: what the non-block part
        makes before the first block counts as ours, what ran between forwards (a VAE) does not."""
        self._peak_before = 0
        self._plan_s = self._capture_s = 0.0
        self._captures = 0
        self._launched = (self.streamer.graphs.cache.first_launches, self.streamer.graphs.cache.first_launch_s)
        self._entry = entry_signature(args, kwargs)
        self._entering = False
        coming = self._coming_workload()
        self._take_idle(coming if coming is not None else self.planner.last_workload)
        with self.memory.one_reading():
            self._retries = self.memory.allocator_retries(self.streamer.device)
            self._others = self.memory.allocated(self.streamer.device) - self.streamer.device_bytes()
        self._entering = True
        if coming is not None and coming != self.planner.last_workload:
            self._apply(self.streamer.resident_indices() & self.planner.preview(coming))
        self.memory.reset_peak(self.streamer.device)

    def _take_idle(self, workload: int | None) -> None:
        """The other denoisers are idle while this one runs: when its plan for ``workload``
        needs more room than is free, their kept blocks make it, in one request (`shared.py`),
        before this plan is fitted (it then keeps what it planned)."""
        if self.shared is not None:
            need = self.planner.room_wanted(workload, self.shared.idle_room(self.streamer))
            self.shared.take_idle(self.streamer, need, f"{self.planner.label} starts")

    def _coming_workload(self) -> int | None:
        """The workload this forward will run: known from an earlier cycle entered the same way,
        else guessed from the last cycle's by how its inputs grew."""
        known = self._workload_by_entry.get(self._entry)
        if known is not None or self._last is None:
            return known
        return scaled_workload(self._entry, *self._last)

    def on_event(self, event: str, streamer: BlockStreamer, **info) -> bool:
        if event == "forward":
            self._forward_begins(info["args"], info["kwargs"])
        elif event == "cycle":
            with self.memory.one_reading():  # the shortage check and the plan's reading, from one table
                reading = None if self._check_shortage() else self.reading()  # (a relief: the planner reads anew)
            workload = int(workload_fn(self.streamer.module)(info["args"], info["kwargs"]))
            self._workload_by_entry[self._entry] = workload
            self._last = (self._entry, workload)
            began = time.perf_counter()
            target = self.planner.begin_cycle(workload, reading=reading)
            self._apply(target)
            self._hold_casts(workload)
            self._plan_s += time.perf_counter() - began
            self._entering = False
            self.memory.reset_peak(streamer.device)  # live activations stay in the reset peak
            self._peak_before = 0
            self._described = streamer.graphs.cache.described
            streamer.reset_peak()
        elif event == "oom":
            block = info["block"]
            return self.relieve(streamer.pieces_of({block.index}) if block is not None else set())
        elif event == "capturing":  # the peak so far is the forward's
            peak = self.memory.peak_allocated(streamer.device)
            self._peak_before = max(self._peak_before, (peak or 0) - self._others)
            self._before_capture = self.memory.allocated(streamer.device)
            self._capture_began = time.perf_counter()
        elif event == "captured":
            self._capture_s += time.perf_counter() - self._capture_began
            self._captures += 1
            # the capture's allocations (its pool, its static buffers) are not activations
            self._others += max(0, self.memory.allocated(streamer.device) - self._before_capture)
            self.memory.reset_peak(streamer.device)
            self._retries = self.memory.allocator_retries(streamer.device)  # nor a shortage
        elif event == "forward_end":  # the cycle's measure is the denoiser's forward alone
            with self.memory.one_reading():
                self._check_shortage()
                usage = self._usage()
            if logger.isEnabledFor(logging.DEBUG):
                self._log_terms(usage)
            self.planner.end_cycle(usage)
        elif event == "end":
            self.planner.end_cycle()  # a forward that raised: nothing to measure
            self._hold = True
        return False

    def _log_terms(self, usage: CycleUsage | None) -> None:
        """One DEBUG line per forward: the terms of its activation measure, in GiB, and the host
        seconds of its plan, its captures and its graphs' first launches (a check replay is one)."""
        s, g = self.streamer, self.streamer.graphs.cache
        terms = {"peak": usage.peak if usage else 0, "floor": usage.weights_floor if usage else 0,
                 "others": self._others, "before_capture_peak": self._peak_before,
                 "head": s.head_bytes(), "kept": s.kept_bytes(), "ring": s.ring.nbytes,
                 "end_alloc": self.memory.allocated(s.device) - s.device_bytes() - self._others,
                 "graph_pool": g.pool_bytes, "graph_io": g.nbytes - g.pool_bytes}
        logger.debug("%s forward: %s; kept %d pieces; graphs %d (captured %d, refused %d, replayed %d), lookahead %d; "
                     "host s: plan %.3f, %d captures %.3f, %d first launches %.3f", self.planner.label,
                     ", ".join(f"{k} {v / 2**30:.3f}" for k, v in terms.items()), len(s.resident_indices()), len(g),
                     g.captured, g.refused, g.replayed, self.planner.ring_slots, self._plan_s, self._captures,
                     self._capture_s, g.first_launches - self._launched[0], g.first_launch_s - self._launched[1])

    def _hold_casts(self, workload: int) -> None:
        """With every piece kept, hold fp8 pieces as compute values in the room the plan leaves
        (which leaves the CUDA graphs what they will need again once dropped: `graphs_to_come`),
        less two unit casts where graphs are on (the cast buffer graphs and eager casts share, and
        one more as headroom: the reserve measured at 24 GiB in runs 32-33). A plan that streams,
        or a shortage in this run, holds none. A change drops the graphs: their keys name the form
        of the weights, and their pool is the room the new captures need."""
        s, cache = self.streamer, self.streamer.graphs.cache
        if not s.held.castable:  # no fp8 units: nothing to do on each forward
            return
        if not self._hold or len(s.resident_indices()) < len(s.pieces):
            changed = s.held.drop() > 0
        else:
            reserve = 2 * s.prefetch.casts.nbytes if cache.enabled else 0
            changed = s.held.fit(self.planner.spare(workload) - reserve)
        if changed:
            s.graphs.clear()
            self.memory.empty_cache(s.device)
            self._retries = self.memory.allocator_retries(s.device)

    def _check_shortage(self) -> bool:
        """The allocator retried since the last look: a shortage, relieved (True when it was)."""
        retries = self.memory.allocator_retries(self.streamer.device)
        relieved = retries > self._retries and self.relieve(set())
        self._retries = retries
        return relieved

    def relieve(self, running: set[int]) -> bool:
        """A shortage: give up what the planner lets go (streaming buffers beyond the window, or
        kept pieces, never those ``running``); False when nothing more can go. Pieces held as
        compute values go first (none is held again this run), then the idle denoisers' kept
        blocks (one streamed block's worth plus the margin, at once)."""
        self._hold = False
        if self.streamer.held.drop(keep=running):
            self.streamer.graphs.clear()
            return True
        need = max(self.planner.buffers.slot_sizes.values(), default=0)
        if self.shared is not None and self.shared.take_idle(self.streamer, need, f"a shortage in {self.planner.label}"):
            return True
        relief = self.planner.on_shortage(running=running)
        if not relief:
            return False
        self._apply(self.streamer.resident_indices() - relief.blocks, planned=False)
        return True

    def _apply(self, target, planned: bool = True) -> None:
        """Change the resident set. On any change the allocator's cache goes back to the driver
        first (the last workload's activation segments would otherwise make the new buffers
        flush and retry), and the retry baseline is re-read after: a retry our own plan change
        caused is not a shortage. The planner's lookahead is applied with it, and a ``planned``
        change (not a shortage's relief, which needs the memory now) makes the streaming
        buffers at once."""
        self.streamer.set_lookahead(self.planner.ring_slots)
        changed = set(target) != self.streamer.resident_indices()
        if changed:
            self.memory.empty_cache(self.streamer.device)
            self.streamer.set_resident(set(target))
            self.memory.empty_cache(self.streamer.device)
        made = planned and self.streamer.fill_ring()
        if changed or made:  # else a retry since the last reading is still to be seen
            self._retries = self.memory.allocator_retries(self.streamer.device)
        self.streamer.graphs.drop_moved(frozenset(target))


def _planner_for(module: torch.nn.Module, streamer: PreloadingStreamer, reading, policy: Policy) -> PreloadPlanner:
    blocks = [BlockInfo(p.index, p.block.tower, p.block.depth, p.nbytes, p.block.pinned or not streamer.cuda,
                        p.largest_unit, len(p.units), p.core) for p in streamer.pieces]
    planner: PreloadPlanner | None = PLANNER.get(module)
    slots = {b.index: b.slot_bytes for b in blocks}
    if planner is None or len(planner.ranking) != len(blocks) or planner.buffers.slot_sizes != slots:
        identity = str(getattr(getattr(module, "config", None), "_name_or_path", "") or "")
        planner = PreloadPlanner(blocks, reading, model_class=type(module).__name__, identity=identity,
                                 policy=policy, prefetch_window=streamer.ctx.prefetch_window,
                                 whole=streamer.binds_whole)
        PLANNER.set(module, planner)
    planner.rebind(reading, policy, streamer.ctx.prefetch_window, streamer.binds_whole)
    return planner

"""Whether a workload's CUDA graphs can pay for their memory. A graph saves the host its launches;
where the device, not the host, sets a forward's pace (the host done launching an eager forward
well before the device is done running it) graphs cannot make the step faster, while their memory
costs the plan kept blocks, and under cudaMallocAsync the room their first launches wait for costs
more (FLUX.2 [dev] at 12 GiB: bench/README.md, runs 66-67). So each workload's second forward runs
eagerly (its captures held back one forward) and its blocks are timed on the host and on the
device; its first pays one-time costs (kernels loaded, algorithms chosen) on both clocks, which
made FLUX.2 read as host-bound. The host waits for the work queued before the clock starts: the
first forward's tail, which a full launch queue or any wait in the timed forward would add to its
launch (FLUX.1's verdict against its synchronized forwards: bench/README.md, runs 69-70). Graphs stand
aside while every workload found so far is device-bound: launched in under 3/4 of its device time
(where graphs stopped paying: bench/README.md, run 68).

A forward in which the host waited for its own device work reads as host-bound: graphs stay."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..log import get_logger
from ..preload.workload import entry_signature

log = get_logger("graphs")

HOST_SHARE = 0.75  # a forward whose eager launch took less than this share of its device time is device-bound


@dataclass
class Timing:
    """One eager forward being timed from its first block's entry (past the plan's changes at its
    cycle's start, which are not launches) to its return."""

    entry: tuple
    host: float = 0.0
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None


class GraphWorth:
    """Times each new workload's second forward (no capture in it) and, as each forward begins,
    switches the streamer's graphs (``switch``) off while every workload judged so far is
    device-bound, on once one is not (for good, and no workload is timed from then on: two workloads
    taking turns never drop and make their graphs again turn by turn). Subscribed after the preload
    driver, so that its cycle's planning runs before the clock starts."""

    NAME = "graph worth"

    def __init__(self, streamer, switch: Callable[[bool], None]) -> None:
        self.streamer = streamer
        self.switch = switch
        self.device_bound: dict[tuple, bool] = {}  # entry signature: the verdict
        self._seen: set[tuple] = set()  # entry signatures whose first forward ran
        self._timing: Timing | None = None
        streamer.events.subscribe(self.NAME, self.on_event)

    def allowed(self) -> bool:  # (made only for a CUDA streamer whose calls may be graphed)
        return bool(self.streamer.ctx.config.cuda_graphs)

    def on_event(self, event: str, streamer, **info) -> bool:
        timing = self._timing
        if event == "forward":
            self._judge()
            entry = entry_signature(info["args"], info["kwargs"])
            want = self.allowed() and not self.aside()
            if want != self.streamer.graphs.cache.enabled:
                self.switch(want)
            if self._open() and entry not in self.device_bound:
                if entry in self._seen:
                    self._timing = Timing(entry)
                    self.streamer.graphs.hold(True)
                self._seen.add(entry)
        elif event == "cycle" and timing is not None and timing.start is None:
            torch.cuda.current_stream(self.streamer.device).synchronize()  # (once a workload)
            timing.host, timing.start = time.perf_counter(), _event(self.streamer.device)
        elif event in ("forward_end", "end") and timing is not None:
            self.streamer.graphs.hold(False)  # (a forward that never entered a block, or raised, is timed again)
            if event == "forward_end" and timing.start is not None and timing.end is None:
                timing.host, timing.end = time.perf_counter() - timing.host, _event(self.streamer.device)
            elif timing.end is None:
                self._timing = None
        return False

    def _open(self) -> bool:
        """Whether a verdict can still change anything: graphs allowed, no workload host-bound yet."""
        return self.allowed() and all(self.device_bound.values())

    def aside(self) -> bool:
        """Whether graphs stand aside now: allowed, some workload judged, and every one device-bound."""
        return self._open() and bool(self.device_bound)

    def _judge(self) -> None:
        """The last timed forward's verdict, once its device work is done (the host waits for it once)."""
        timing, self._timing = self._timing, None
        if timing is None or timing.start is None or timing.end is None:
            return
        timing.end.synchronize()
        device = timing.start.elapsed_time(timing.end) / 1000
        bound = device_paced(timing.host, device)
        self.device_bound[timing.entry] = bound
        log.info("%s: an eager forward launched in %.3f s, ran on the device in %.3f s: %s",
                 type(self.streamer.module).__name__, timing.host, device,
                 "device-bound" + (", CUDA graphs stand aside" if self.aside() else "") if bound
                 else "CUDA graphs on")


def device_paced(host_s: float, device_s: float) -> bool:
    """Whether an eager forward the host launched in ``host_s`` and the device ran in ``device_s``
    was paced by the device: graphs could not make it faster."""
    return host_s < HOST_SHARE * device_s


def _event(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event

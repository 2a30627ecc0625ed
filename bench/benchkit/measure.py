"""Device-side measuring: the ballast that imitates a smaller card, synchronized timing, the
allocator's peaks around the engine's own resets, pinned bandwidth, device memory polled.

Timing: synchronize -> perf_counter -> forward -> synchronize; the median of the timed forwards
after the warm-up ones. On the CPU (smoke runs) synchronizing and the CUDA readings are no-ops.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

from . import GiB, MiB

log = logging.getLogger("bench")


def cuda_used() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def sync() -> None:
    if cuda_used():
        torch.cuda.synchronize()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def alloc_counts() -> tuple[int, int]:
    """(OOMs, flush-and-retry events) torch's allocator has counted in this process."""
    if not cuda_used():
        return 0, 0
    s = torch.cuda.memory_stats()
    return int(s.get("num_ooms", 0)), int(s.get("num_alloc_retries", 0))


def peak_alloc_gib() -> float:
    return torch.cuda.max_memory_allocated() / GiB if cuda_used() else 0.0


def to_host(m: torch.nn.Module) -> float:
    """Move every weight to pageable host memory (where a loaded model rests); seconds taken."""
    t0 = time.perf_counter()
    for t in (*m.parameters(), *m.buffers()):
        t.data = t.data.to("cpu")
    if cuda_used():
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def h2d_bandwidth() -> float:
    """Pinned host-to-device bytes/s on a side stream (1 GiB copies, median of the last 6 of 8)."""
    src = torch.empty(GiB, dtype=torch.uint8).pin_memory()
    dst = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    times = []
    for _ in range(8):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        s.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    torch._C._host_emptyCache()
    return GiB / statistics.median(times[2:])


class PeakWatch:
    """The process's allocator peaks over many forwards. The engine's planner resets torch's peak
    statistics when a forward begins and at its first block, so the watch reads them just before
    each reset (subscribed first to the streamer's events) and after each forward (``sample``).
    The reading at a forward's start covers the time since the last forward ended (the bench's
    own work): it counts for the whole run, not for the forward that begins."""

    NAME = "bench.peaks"

    def __init__(self, streamer=None) -> None:
        self.alloc = self.reserved = 0  # since the watch began
        self.interval = (0, 0)  # (alloc, reserved) since the last ``take``
        if streamer is not None and hasattr(streamer, "events"):
            streamer.events.subscribe(self.NAME, self._on_event, first=True)

    def _on_event(self, event: str, streamer, **info) -> bool:
        if event in ("forward", "cycle"):
            self.sample(interval=event == "cycle")
        return False

    def sample(self, interval: bool = True) -> None:
        if not cuda_used():
            return
        alloc, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        self.alloc, self.reserved = max(self.alloc, alloc), max(self.reserved, reserved)
        if interval:
            self.interval = (max(self.interval[0], alloc), max(self.interval[1], reserved))

    def take(self) -> tuple[float, float]:
        """(alloc, reserved) GiB peaks since the last call."""
        self.sample()
        out, self.interval = self.interval, (0, 0)
        return out[0] / GiB, out[1] / GiB


class GcWatch:
    """Python's garbage collections per generation and the seconds they took, since ``reset``:
    is a slow step on the host a full collection landing inside the timed forwards? Read by
    ``timed`` for its timed forwards (``GC.last``)."""

    def __init__(self) -> None:
        self.counts, self.seconds, self._t0, self.last = [0, 0, 0], 0.0, 0.0, {}
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t0

    def reset(self) -> None:
        self.counts, self.seconds = [0, 0, 0], 0.0

    def snapshot(self) -> dict:
        return dict(gc_gen0=self.counts[0], gc_gen1=self.counts[1], gc_gen2=self.counts[2],
                    gc_ms=round(self.seconds * 1e3, 2))


GC = GcWatch()


def timed(fn: Callable[[], torch.Tensor], warmup: int, repeats: int, watch: PeakWatch | None = None,
          after: Callable[[], object] | None = None) -> tuple[float, list[float], torch.Tensor]:
    """(median s, every timed run, last output) of ``fn``. The peak statistics are reset once,
    before the warm-up; ``watch`` samples them around the planner's own resets. ``after`` runs
    after every forward (warm-up ones included), outside the timed span."""
    sync()
    if cuda_used():
        torch.cuda.reset_peak_memory_stats()
    watch = watch or PeakWatch()
    watch.alloc = watch.reserved = 0
    out = None
    for _ in range(warmup):
        out = fn()
        watch.sample()
        if after is not None:
            after()
    runs = []
    GC.reset()
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        runs.append(time.perf_counter() - t0)
        watch.sample()
        if after is not None:
            after()
    GC.last = GC.snapshot()  # includes the watch's and ``after``'s allocations between forwards
    return statistics.median(runs), runs, out


class SyncLoads:
    """The streamer's count of streamed units bound without a copy ahead by its side stream
    (``details()["sync_loads"]``, cumulative since placement), and of the bytes it copied to the
    device (``prefetch.copied``), read after each forward (``mark``). Without a side stream (the
    CPU) the streamer counts no sync loads: ``side_stream`` says so. A transport without the
    counts (leaf, model, none) reads None."""

    def __init__(self, transport) -> None:
        self.transport = transport
        details = self.details()
        self.side_stream = bool(details.get("stream", False))
        self.marks = [details.get("sync_loads")]
        self.copied = [self.copied_bytes()]

    def details(self) -> dict:
        return self.transport.details() if hasattr(self.transport, "details") else {}

    def copied_bytes(self) -> int | None:
        prefetch = getattr(self.transport, "prefetch", None)
        return getattr(prefetch, "copied", None)

    def mark(self) -> None:
        self.marks.append(self.details().get("sync_loads"))
        self.copied.append(self.copied_bytes())

    def moved_gib(self, warmup: int, repeats: int) -> float | None:
        """GiB copied to the device per timed forward (what the bound should divide by H2D: the
        plan may still change while the row is timed, so the plan's streamed bytes at the end are
        not always what moved)."""
        marks = self.copied
        if len(marks) < warmup + repeats + 1 or marks[warmup] is None:
            return None
        return (marks[warmup + repeats] - marks[warmup]) / repeats / 2**30

    def delta(self, a: int, b: int) -> int | None:
        if self.marks[0] is None or len(self.marks) <= max(a, b):
            return None
        return self.marks[b] - self.marks[a]

    def fields(self, warmup: int, repeats: int) -> dict:
        """The row's fields after ``timed(..., warmup, repeats, after=mark)`` and optionally one
        more ``mark`` (a loop): the first forward, the warm-ups (the first included), the timed
        forwards, the loop, and the count since placement."""
        n = warmup + repeats
        return dict(sync_loads_first=self.delta(0, 1), sync_loads_warmup=self.delta(0, warmup),
                    sync_loads_timed=self.delta(warmup, n), sync_loads_loop=self.delta(n, n + 1),
                    sync_loads_total=self.marks[-1], sync_side_stream=self.side_stream,
                    moved_gib=self.moved_gib(warmup, repeats))


def python_speed_ms(repeats: int = 5) -> float:
    """The median time of a fixed pure-Python workload (calls, attribute reads, small tuples): the
    host's own speed in this process, to tell a slow host from slow engine code."""

    class Box:
        def __init__(self, v: int) -> None:
            self.v = v

        def get(self) -> tuple[int, int]:
            return self.v, self.v + 1

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        total = 0
        for i in range(200_000):
            a, b = Box(i).get()
            total += a + b
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def loop_time(fn: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """The mean step of ``repeats`` calls queued back to back with one synchronize at the end (after
    ``warmup`` calls), as a sampling loop runs them: the host's work at a forward's start then
    overlaps the last forward's GPU work, where ``timed`` leaves the GPU waiting for it."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats


def launch_and_step(fn: Callable[[], object], repeats: int = 5, warmup: int = 2) -> tuple[float, float, float]:
    """After ``warmup`` calls: the median host time until ``fn`` returns (its launches) and until
    the GPU is done, each call synchronized, and `loop_time` of ``repeats`` calls. A launch time
    equal to the step is a host-bound step (step_profile.py, host_profile.py)."""
    for _ in range(warmup):
        fn()
    launch, step = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        launch.append(time.perf_counter() - t0)
        sync()
        step.append(time.perf_counter() - t0)
    return statistics.median(launch), statistics.median(step), loop_time(fn, repeats)


@functools.cache
def _nvml_handle():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:
        return None


def nvml_used() -> int | None:
    """Device bytes in use as the driver counts them (NVML, bypassing the CUDA runtime), if pynvml is there."""
    handle = _nvml_handle()
    return None if handle is None else int(handle[0].nvmlDeviceGetMemoryInfo(handle[1]).used)


class Ballast:
    """A second process holds device memory, so that this process sees a smaller card: the engine
    reads the free memory (``mem_get_info``) that card would report, and its own allocator peak
    stays its own (an in-process ballast would land in it).

    ``Ballast(cap)`` leaves ``cap`` GiB of room as this process reads it: the card's free memory
    and the bytes this process's allocator caches but no tensor holds (the holder's own CUDA
    context is taken as 600 MiB: a 12 GiB cap reads 12.07 GiB free on the H200). With ``card``,
    the card holds ``cap`` GiB in all, what this process already uses included: the holder sizes
    itself once its own context exists, with the default allocator (comfy_coexist.py)."""

    CODE = ("import sys, torch; mode, n = sys.argv[1], int(sys.argv[2]); free = torch.cuda.mem_get_info()[0]; "
            "n = n if mode == 'hold' else max(free - n, 0); x = torch.empty(n, dtype=torch.uint8, device='cuda'); "
            "torch.cuda.synchronize(); print('held', n, flush=True); sys.stdin.read()")

    def __init__(self, cap_gib: float | None, card: bool = False) -> None:
        self.proc = None
        self.hold = self.used = self.cached = 0
        self.nvml_used: int | None = None
        if not cap_gib:
            return
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        nvml0 = nvml_used()
        self.used_before = total - free
        env = None
        if card:
            mode, n = "leave", int(cap_gib * GiB) - self.used_before
            if n <= 0:
                raise SystemExit(f"cap {cap_gib} GiB is below what this process already uses ({self.used_before / GiB:.2f} GiB)")
            env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        else:  # the engine counts this process's cached bytes as room (preload/fit.py): so does the cap
            self.cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
            mode, n = "hold", int(free + self.cached - cap_gib * GiB - 600 * MiB)
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, mode, str(n)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "held":
            raise SystemExit("ballast process failed")
        self.hold = int(line[1])
        self.free_after = torch.cuda.mem_get_info()[0]
        self.used = free - self.free_after  # its allocation and its CUDA context
        nvml1 = nvml_used()
        self.nvml_used = None if nvml0 is None or nvml1 is None else nvml1 - nvml0
        self.card = total - self.used  # what the imitated card holds in all
        log.info("ballast holds %.1f GiB: %.1f GiB free", self.hold / GiB, self.free_after / GiB)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc = None
        if cuda_used():
            torch.cuda.empty_cache()


class MemoryPoller(threading.Thread):
    """Device memory used, polled in the background (cudaMemGetInfo; NVML as a cross-check):
    peaks and least free per phase (``reset``) and over the whole run."""

    def __init__(self, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.dt = interval_s
        self.stop_ev = threading.Event()
        self.lock = threading.Lock()
        self.total = torch.cuda.mem_get_info()[1]
        self.run_peak = self.run_peak_nvml = self.samples = 0
        self.run_min_free: int | None = None
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.peak = self.peak_nvml = 0
            self.min_free: int | None = None

    def sample(self) -> None:
        used, nv = self.total - torch.cuda.mem_get_info()[0], nvml_used()
        with self.lock:
            self.samples += 1
            self.peak, self.run_peak = max(self.peak, used), max(self.run_peak, used)
            free = self.total - used
            self.min_free = free if self.min_free is None else min(self.min_free, free)
            self.run_min_free = free if self.run_min_free is None else min(self.run_min_free, free)
            if nv is not None:
                self.peak_nvml, self.run_peak_nvml = max(self.peak_nvml, nv), max(self.run_peak_nvml, nv)

    def run(self) -> None:
        while not self.stop_ev.is_set():
            self.sample()
            self.stop_ev.wait(self.dt)

    def stop(self) -> None:
        self.stop_ev.set()
        self.join()
        self.sample()

"""A profiler trace of one forward, summarised (`step_profile.py`): the copy engine's and the
kernels' busy time, their overlap and idle gaps, the compute stream's gaps by what they lie
between, and the host's CUDA API time."""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from pathlib import Path


def trace_summary(path: str) -> dict:
    """Copy-engine and kernel busy time over the traced forward, how much of it overlapped, and
    the idle gaps of each (over 0.3 ms, with where they start): whether copies wait for buffers
    (copy gaps while kernels run) or compute waits for copies (kernel gaps while a copy runs)."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kernels = merged([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"])
    copies = merged([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "gpu_memcpy"])
    if not kernels or not copies:
        return dict(path=path, kernels_ms=sum(b - a for a, b in kernels) / 1e3, host_api=api_time(events))
    start = min(kernels[0][0], copies[0][0])
    end = max(kernels[-1][1], copies[-1][1])
    busy = lambda spans: sum(b - a for a, b in spans)  # noqa: E731
    overlap = busy(kernels) + busy(copies) - busy(merged(kernels + copies))
    return dict(span_ms=(end - start) / 1e3, kernels_ms=busy(kernels) / 1e3, copies_ms=busy(copies) / 1e3,
                overlap_ms=overlap / 1e3, first_copy_at_ms=(copies[0][0] - start) / 1e3,
                last_kernel_end_ms=(kernels[-1][1] - start) / 1e3, kernel_gaps=gaps(kernels, start),
                copy_gaps=gaps(copies, start), host_api=api_time(events), compute_gaps=compute_gaps(events))


def compute_gaps(events: list[dict]) -> dict[str, list[float]]:
    """Every idle gap of the compute stream (the stream with the most kernel time), summed by what
    it lies between: ``graph`` (a kernel of a CUDA graph), ``in_graph`` (two kernels of one graph
    replay), ``kernel`` (launched eagerly), ``memcpy``; ``after_copy``: the next op started within
    20 us of a side-stream copy's end (it waited for that copy). Name -> [gaps, total ms]. Where a
    step's time over its kernels goes, when no single gap is large."""
    launcher = {e["args"]["correlation"]: e["name"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "stream" in e.get("args", {})]
    busy: dict[int, float] = {}
    for e in ops:
        if e["cat"] == "kernel":
            busy[e["args"]["stream"]] = busy.get(e["args"]["stream"], 0.0) + e["dur"]
    if not busy:
        return {}
    compute = max(busy, key=busy.get)
    mine = sorted((e for e in ops if e["args"]["stream"] == compute), key=lambda e: e["ts"])
    copy_ends = sorted(e["ts"] + e["dur"] for e in ops if e["args"]["stream"] != compute and e["cat"] == "gpu_memcpy")

    def kind(e: dict) -> str:
        if e["cat"] != "kernel":
            return "memcpy"
        return "graph" if launcher.get(e["args"].get("correlation")) == "cudaGraphLaunch" else "kernel"

    out: dict[str, list[float]] = {}
    for a, b in zip(mine, mine[1:], strict=False):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap <= 0:
            continue
        same = kind(a) == kind(b) == "graph" and a["args"].get("correlation") == b["args"].get("correlation")
        name = "in_graph" if same else f"{kind(a)}>{kind(b)}"
        if bisect_right(copy_ends, b["ts"]) > bisect_left(copy_ends, b["ts"] - 20):
            name = "after_copy"
        n, total = out.get(name, [0, 0.0])
        out[name] = [n + 1, round(total + gap / 1e3, 3)]
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))



def api_time(events: list[dict]) -> dict[str, list[float]]:
    """The host's CUDA runtime and driver calls in the trace: name -> [calls, total ms, longest
    ms]. Whether a slow launch is spent in the driver (copies issued from registered pages,
    event waits) or in Python between the calls."""
    out: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            n, total, longest = out.get(e["name"], [0, 0.0, 0.0])
            out[e["name"]] = [n + 1, round(total + e["dur"] / 1e3, 3), round(max(longest, e["dur"] / 1e3), 3)]
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping (start, end) spans joined, in time order."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def gaps(spans: list[tuple[float, float]], start: float, least_us: float = 300.0) -> list[list[float]]:
    """[at ms, length ms] of each idle gap between ``spans`` longer than ``least_us``."""
    return [[round((b0 - start) / 1e3, 2), round((a1 - b0) / 1e3, 2)]
            for (_a0, b0), (a1, _b1) in zip(spans, spans[1:], strict=False) if a1 - b0 > least_us]

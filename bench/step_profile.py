"""Where a preloaded step's time goes: the host's launch time against the GPU's, and a profiler
trace of one forward (Wan-14B geometry, or ``--model`` an image model's step; ballast cap; benchkit).

Why: it tells a host-bound step (launch time ≈ step time) from exposed copies (the compute stream
idle while a copy runs); it traced the 24 GiB image-sized step to its bound (bench/README.md).
Each row also lays one launch out block by block, sums the CUDA API calls' host time, watches the
CPU (`benchkit/cpuwatch.py`) and pairs forwards with a pure-Python probe of the host's speed: the
GPU machine's CPU speed drifts within a process (run 28).

    python bench/step_profile.py --caps 24 --trace $OUT/trace.json
"""

from __future__ import annotations

import argparse
import time
import timeit

import torch
import torch.nn.functional as F
from benchkit import Rows, open_output, output_args, pack
from benchkit.cpuwatch import CpuWatch
from benchkit.image_models import IMAGE_MODELS
from benchkit.measure import Ballast, launch_and_step, python_speed_ms, sync, to_host
from benchkit.models import FP8_STORAGES, blocks_of, build_wan, store_fp8_as, wan_forward, wan_inputs
from benchkit.trace_gaps import trace_summary

pack()
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core.memory import MemoryReader  # noqa: E402

row = Rows()
FORWARD = wan_forward  # an image model's with --model


def in_hooks(streamer, names=("enter_block", "enter", "exit")) -> list[float]:
    """Count the host time spent in the streamer's methods ``names`` (outermost calls only): by
    default its hook entry points (the rest of the launch time beyond resident is diffusers' hook
    dispatch and the model); ``("notify",)``: the preload driver's work at a forward's and a
    cycle's start, all of it before the first block is launched, while a synchronized step's GPU
    waits."""
    spent, depth = [0.0], [0]
    for name in names:
        def timed(*a, _fn=getattr(streamer, name), **k):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[0] += time.perf_counter() - t0
        setattr(streamer, name, timed)  # an instance attribute shadows the method for this process
    return spent


def reading_costs(repeats: int = 200) -> None:
    """Host microseconds per allocator reading: the flat table against the nested one the engine
    reads, and the driver's free-memory query."""
    calls = {
        "memory_stats": torch.cuda.memory_stats, "memory_stats_as_nested_dict": torch.cuda.memory_stats_as_nested_dict,
        "memory_allocated": torch.cuda.memory_allocated, "mem_get_info": torch.cuda.mem_get_info,
        "MemoryReader.device_free": lambda: MemoryReader().device_free(torch.device("cuda")),
        "MemoryReader.allocated": lambda: MemoryReader().allocated(torch.device("cuda")),
    }
    for call in calls.values():  # warm
        call()
    row(section="reading_us", **{name: timeit.timeit(call, number=repeats) / repeats * 1e6 for name, call in calls.items()})


def block_clock(m) -> tuple[list[int], list]:
    """Host time stamps (ns) at each block's call, before any hook of the engine: one forward's
    launch laid out block by block (``gaps_ms``), to tell a uniform slowdown from stalls."""
    stamps: list[int] = []
    handles = [b.register_forward_pre_hook(lambda *_: stamps.append(time.perf_counter_ns())) for b in blocks_of(m)]
    return stamps, handles


def gaps_ms(stamps: list[int], start: int) -> list[float]:
    """The host time from ``start`` to the first block, then from each block to the next."""
    return [round((b - a) / 1e6, 3) for a, b in zip([start, *stamps], stamps, strict=False)]


def per_call_us(fn, n: int = 2000) -> float:
    """Host microseconds per call of ``fn`` (after 50 warm calls)."""
    for _ in range(50):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    sync()
    return round(us, 2)


def host_probe(m) -> dict:
    """Host microseconds per call, in this process now: pure Python (`python_speed_ms`), a small
    CUDA op (dispatch and launch), and ``F.linear`` with block 0's first weight as the model holds
    it (under the engine, bound into the engine's buffer) against a plain copy. Whether a slow launch is
    the interpreter, the dispatcher, or the tensors the engine binds."""
    weight = next(p for p in blocks_of(m)[0].parameters() if p.dim() == 2)
    a = torch.ones(1, device=weight.device)
    if not weight.is_floating_point() or weight.element_size() == 1:  # fp8 storage: no F.linear on it
        with torch.inference_mode():
            return dict(python_ms=round(python_speed_ms(), 1), add_us=per_call_us(lambda: torch.add(a, a)))
    x = torch.randn(1, weight.shape[1], device=weight.device, dtype=weight.dtype)
    plain = weight.detach().clone()

    with torch.inference_mode():
        return dict(python_ms=round(python_speed_ms(), 1), add_us=per_call_us(lambda: torch.add(a, a)),
                    linear_bound_us=per_call_us(lambda: F.linear(x, weight)),
                    linear_plain_us=per_call_us(lambda: F.linear(x, plain)))


def clocked(m, feeds, forwards: int = 10) -> dict:
    """One synchronized forward with the block clock on (the launch's time to each block), then
    ``forwards`` more under `CpuWatch` (who used the CPU meanwhile)."""
    stamps, handles = block_clock(m)
    try:
        sync()
        t0 = time.perf_counter_ns()
        FORWARD(m, *feeds)
        t1 = time.perf_counter_ns()
        sync()
    finally:
        for h in handles:
            h.remove()
    with CpuWatch() as watch:
        for _ in range(forwards):
            FORWARD(m, *feeds)
            sync()
    return {"block_gaps_ms": gaps_ms(stamps, t0), "after_last_ms": round((t1 - stamps[-1]) / 1e6, 3),
            "cpu": watch.result, "probe": host_probe(m), "paired": paired(m, feeds)}


def paired(m, feeds, forwards: int = 12) -> list[list[float]]:
    """[pure-Python probe ms, launch ms, step ms] of ``forwards`` synchronized forwards, each right
    after its own probe: a step compared with the host's speed at that moment, not the process's."""
    out = []
    for _ in range(forwards):
        probe = python_speed_ms(repeats=1)
        sync()
        t0 = time.perf_counter()
        FORWARD(m, *feeds)
        t1 = time.perf_counter()
        sync()
        out.append([round(probe, 1), round((t1 - t0) * 1e3, 2), round((time.perf_counter() - t0) * 1e3, 2)])
    return out


def trace(m, feeds, path: str, with_host: bool) -> None:
    """CUDA activity only by default: recording every host op stretched a 109 ms step to 158 ms
    on the H200, which is not the timeline being asked about."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if with_host else [])]
    with profile(activities=activities) as prof:
        FORWARD(m, *feeds)
        sync()
    prof.export_chrome_trace(path)
    row(section="trace", **trace_summary(path))


def by_hand(m, feeds, streamer, sets: list[str], window: int, warmup: int) -> None:
    """Rows with the planner detached and the streamed pieces set by hand (the resident set is
    restored after): the effect of where they sit, at the same count. A set is block indices
    (whole blocks stream), ``plan`` (the plan's own), or ``mirror``: the plan's streamed pieces,
    block ``i``'s moved to block ``n-1-i``. A ``:nocross`` suffix queues no copy across a forward's end (the next forward's
    first units are copied from its entry): `Prefetcher.prefetch_after`'s ``next_forward`` at 0."""
    planned = streamer.resident_indices()
    planner = streamer.events.unsubscribe("preload")
    order, upcoming = streamer.prefetch.order, streamer.prefetch.order.upcoming
    try:
        for text in sets:
            spec, _, cross = text.partition(":")
            everything = {p.index for p in streamer.pieces}
            streamed = everything - planned if spec == "plan" else mirrored(streamer, planned) if spec == "mirror" \
                else streamer.pieces_of({int(i) for i in spec.split(",")})
            order.upcoming = upcoming if cross != "nocross" else (  # this instance only
                lambda index, count, next_forward=None: upcoming(index, count, None if next_forward is None else 0))
            streamer.set_resident(everything - streamed)
            names = sorted(piece_name(p) for p in streamer.pieces if p.index in streamed)
            try:
                launch, step, loop = launch_and_step(lambda: FORWARD(m, *feeds), warmup=warmup)
            except torch.OutOfMemoryError:  # the planner, which would give blocks up, is detached
                row(section="by_hand", set=text, window=window, streamed=names, error="out of memory")
                continue
            row(section="by_hand", set=text, window=window, streamed=names, launch_s=launch, step_s=step, loop_s=loop)
    finally:
        order.upcoming = upcoming
        streamer.set_resident(planned)
        if planner is not None:
            streamer.events.subscribe("preload", planner)


def mirrored(streamer, resident: set[int]) -> set[int]:
    """The pieces not in ``resident``, each moved to the same kind of piece of block ``n-1-i``."""
    n, by_name = len(streamer.blocks), {piece_name(p): p.index for p in streamer.pieces}
    out = set()
    for p in streamer.pieces:
        if p.index not in resident:
            index = p.block.index
            out.add(by_name[f"{n - 1 - index}{piece_name(p)[len(str(index)):]}"])
    return out


def piece_name(piece) -> str:
    """A block's index, with ``c`` for its core or ``r`` for its rest where it streams in parts."""
    return f"{piece.block.index}{'c' if piece.core else 'r' if len(piece.block.units) > 1 else ''}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("wan", *IMAGE_MODELS), default="wan", help="an image model: its 1024x1024 step")
    ap.add_argument("--caps", default="24")
    ap.add_argument("--workload", default="small")
    ap.add_argument("--whole-blocks", action="store_true")
    ap.add_argument("--storage", default="bf16", choices=["bf16", *FP8_STORAGES], help="fp8: Linear weights stored "
                    "in fp8 (bf16 compute; _fast: fp8 matmuls); its resident row: the engine keeping every block")
    ap.add_argument("--compile", action="store_true", help="the engine rows and fp8's reference compile_blocks")
    ap.add_argument("--trace", default="", help="chrome trace of one forward at the first cap")
    ap.add_argument("--with-host", action="store_true", help="the trace records host ops too")
    ap.add_argument("--window", default="1", help="prefetch windows of the engine rows (each cap once per window)")
    ap.add_argument("--streamed", action="append", default=[],
                    help="after the first cap's auto row, the same placement with exactly these blocks streamed "
                         "(comma-separated; repeatable): which blocks stream, at the same count; 'plan' or 'mirror' "
                         "(the plan's streamed pieces, mirrored along the tower), ':nocross' for no copy queued "
                         "across a forward's end (`by_hand`)")
    ap.add_argument("--per-part", action="store_true",
                    help="the first cap again with streaming blocks' parts graphed one by one (the A/B of whole-block graphs)")
    ap.add_argument("--slots", type=int, action="append", default=[],
                    help="the first cap again with exactly this many streaming buffers (repeatable; with --per-part, both ways)")
    ap.add_argument("--no-graphs", action="store_true", help="every engine row with cuda_graphs off")
    ap.add_argument("--warmup", type=int, default=10,
                    help="forwards before the engine rows are timed (the plan settles, then graphs are captured)")
    output_args(ap)
    args = ap.parse_args()
    global row, FORWARD
    row = open_output(args, "step_profile", lines=True)
    image = IMAGE_MODELS.get(args.model)
    m, feeds = (image.build("cuda"), image.inputs("image")) if image else (build_wan(40), wan_inputs(args.workload, 21))
    FORWARD = image.forward if image else wan_forward
    reading_costs()
    if args.storage in FP8_STORAGES or args.compile:
        if args.storage in FP8_STORAGES:
            store_fp8_as(m, args.storage)
        fp8_resident(m, feeds, args)
    else:
        row(section="resident", launch_s=(r := launch_and_step(lambda: FORWARD(m, *feeds)))[0], step_s=r[1],
            loop_s=r[2], **clocked(m, feeds))
        if args.trace:
            trace(m, feeds, args.trace.replace(".json", "_resident.json"), args.with_host)
    to_host(m)
    first = float(args.caps.split(",")[0])
    for cap in [float(c) for c in args.caps.split(",")] + [0.0]:
        for window in [int(w) for w in args.window.split(",")]:
            auto_row(m, feeds, cap, window, args, extras=cap == first)
            for slots in args.slots if cap == first else ():
                auto_row(m, feeds, cap, window, args, extras=False, slots=slots)
            for slots in [0, *args.slots] if args.per_part and cap == first else ():
                auto_row(m, feeds, cap, window, args, extras=not slots, per_part=True, slots=slots)


def fp8_resident(m, feeds, args) -> None:
    """fp8's (and compile's) reference row: every block kept by a fixed budget (one cast per unit
    each forward, its kept blocks graphed whole; nothing held as compute values), timed and traced
    like the capped rows, so their gaps can be told apart from the reference's."""
    eng, bag = Engine(), Components(transformer=m)
    try:
        eng.place(bag, OffloadConfig(preload="1000", stream_parts=not args.whole_blocks, compile_blocks=args.compile,
                                     cuda_graphs=not args.no_graphs))
        launch, step, loop = launch_and_step(lambda: FORWARD(m, *feeds), warmup=args.warmup)
        row(section="fp8_resident", launch_s=launch, step_s=step, loop_s=loop, **clocked(m, feeds))
        if args.trace:
            trace(m, feeds, args.trace.replace(".json", "_resident.json"), args.with_host)
    finally:
        eng.release(bag)


def auto_row(m, feeds, cap: float, window: int, args, extras: bool, per_part: bool = False, slots: int = 0) -> None:
    """The engine at ``cap`` with preload auto; at the first cap, the trace and hand-set rows.
    ``per_part``: a streaming block in parts is never bound whole, so its parts are graphed one
    by one (as before whole-block graphs; `BlockStreamer._bind_whole`). ``slots``: the planner
    fits and fills exactly that many streaming buffers."""
    ballast = Ballast(cap) if cap else None
    eng, bag = Engine(), Components(transformer=m)
    try:
        eng.place(bag, OffloadConfig(stream_parts=not args.whole_blocks, prefetch_window=window,
                                     compile_blocks=args.compile, cuda_graphs=not args.no_graphs))
        streamer = eng.states(bag)["transformer"].transport
        if per_part:
            streamer._bind_whole = lambda *_: False  # this instance only
        if slots:
            planner = streamer.driver.planner
            planner.buffers.base = planner.buffers.most = slots  # its next cycle plans with them
        spent, driver = in_hooks(streamer), in_hooks(streamer, ("notify",))
        launch, step, loop = launch_and_step(lambda: FORWARD(m, *feeds), warmup=args.warmup)
        spent[0] = driver[0] = 0.0
        sync()
        FORWARD(m, *feeds)
        row(section="auto", cap_gib=cap or None, window=window, per_part=per_part, slots=slots or None, launch_s=launch, step_s=step, loop_s=loop,
            in_hooks_s=spent[0], in_driver_s=driver[0], kept=streamer.details()["kept"], buffers=streamer.ring.capacity,
            streamed=[piece_name(p) for p in streamer.pieces if p.resident is None],
            streamed_gib=streamer.streamed_bytes() / 2**30, **clocked(m, feeds))
        if extras and cap:
            if args.trace:
                trace(m, feeds, args.trace.replace(".json", f"_w{window}{'_pp' if per_part else ''}.json"), args.with_host)
            if args.streamed:
                by_hand(m, feeds, streamer, args.streamed, window, args.warmup)
    finally:
        eng.release(bag)
        if ballast is not None:
            ballast.close()


if __name__ == "__main__":
    main()

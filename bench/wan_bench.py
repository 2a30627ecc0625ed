"""Wan-2.1-14B-geometry transformer (random bf16 weights) under the engine and the anchors, side by side.

One process, one model: it is built on the GPU (benchkit.models), timed resident, moved to pageable
host memory, then placed and released per row. Smaller cards are imitated with a ballast process
made before each capped row (benchkit.measure.Ballast), so the planner sees the free memory such a
card would report. Each timed forward is synchronize -> perf_counter -> forward -> synchronize; the
median of ``--repeats`` after ``--warmup`` forwards. Parity is against the resident output of the
same process. The run ends with the side-by-side table (benchkit.table).

    python bench/wan_bench.py --sections stream,preload --caps 12,24 --out $OUT   # the headline rows
    python bench/wan_bench.py --self-check                                        # CPU: the table's ratios
    python bench/wan_bench.py --tiny --sections stream,preload,firstk,cycles,anchors --caps 12  # CPU dry run

Sections:
  modes    every engine mode on a short model (--mode-blocks): parity, step time, peak VRAM
  stream   full streaming (preload off): small and video, against the bound
  preload  preload auto at each cap
  firstk   hand-picked "first K blocks resident" at each cap (the manual knob users set today)
  anchors  diffusers block_level+stream and leaf_level+stream
  cycles   30 cycles alternating the workloads at the tightest cap: OOMs, peak, plan lines
  mmgp     mmgp 3.8.2 (WanGP's engine) keeping --mmgp-kept blocks at the first cap; runs last, and
           needs ``mmgp`` and ``optimum-quanto`` (carry their wheels: the GPU machine has no network)
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time

from benchkit import GB, GiB, Rows, open_output, output_args, pack
from benchkit.table import self_check, side_by_side

if "--self-check" in sys.argv:  # no torch, no GPU
    sys.exit(self_check())

import psutil  # noqa: E402
import torch  # noqa: E402
from benchkit.measure import (  # noqa: E402
    Ballast,
    PeakWatch,
    alloc_counts,
    cuda_used,
    h2d_bandwidth,
    loop_time,
    peak_alloc_gib,
    rel_err,
    sync,
    timed,
    to_host,
)
from benchkit.models import build_wan, nbytes, wan_forward, wan_inputs  # noqa: E402

pack()
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core import memory as engine_memory  # noqa: E402
from diffusers_offload.offload_core.pinning import pinned_bytes  # noqa: E402

DIFFUSERS_GROUP_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")
row = Rows()
DEV = "cuda"  # "cpu" with --tiny: the dry run that checks the flow, not the speed


def run(m, feeds, warmup, repeats, watch=None):
    return timed(lambda: wan_forward(m, *feeds), warmup, repeats, watch)


def loop(m, feeds, repeats: int) -> float:
    return loop_time(lambda: wan_forward(m, *feeds), repeats)


def config(args, **kw) -> OffloadConfig:
    """The engine's config for a row: ``--whole-blocks`` streams each block whole; ``--window``
    sets the prefetch window (the ring holds window + 1 of the largest unit). The CPU dry run has
    no ballast: preload auto becomes a fixed budget of about one block."""
    if DEV == "cpu" and kw.get("preload") == "auto":
        kw["preload"] = args.tiny_budget_gib
    return on_dev(stream_parts=not args.whole_blocks, prefetch_window=args.window, **kw)


def on_dev(**kw) -> OffloadConfig:
    if DEV == "cpu":
        kw = dict(kw, device="cpu", on_demand_threshold_gb=0, resident_floor_mb=0)
    return OffloadConfig(**kw)


def ballast(cap: float | None) -> Ballast:
    return Ballast(cap if DEV == "cuda" else None)


def free_now() -> int:
    return torch.cuda.mem_get_info()[0] if DEV == "cuda" else 0


def firstk_rows(m, cap, auto: dict[str, dict], refs, feeds, args) -> None:
    """The manual knob around what the planner chose: small at K-2, K, K+2; video at its K. K is
    the whole blocks the plan's kept bytes would buy (it keeps pieces: block cores first)."""
    block = nbytes(m.blocks[0])
    kept = {w: round(r["kept_gib"] * GiB / block) for w, r in auto.items()}
    for k in sorted({max(0, kept["small"] + d) for d in (-2, 0, 2)}):  # K=0 is the stream row
        try:
            run_engine(f"first_{k}", m, config(args, preload="off"), cap, refs, feeds, args, firstk=k,
                       workloads=("small",))
        except torch.OutOfMemoryError as e:
            row(section=f"first_{k}", cap_gib=cap, workload="small", error=f"OOM: {str(e)[:100]}")
            gc.collect()
            torch.cuda.empty_cache()
    if "video" in auto and not args.no_firstk_video:
        k = kept["video"]
        run_engine(f"first_{k}", m, config(args, preload="off"), cap, refs, feeds, args, firstk=k,
                   workloads=("video",))


def run_engine(label: str, m, cfg: OffloadConfig, cap, refs, feeds, args, firstk: int | None = None,
               workloads=("small", "video")) -> dict[str, dict]:
    hold = ballast(cap)
    free0 = free_now()
    eng, bag = Engine(), Components(transformer=m)
    proc = psutil.Process()
    try:
        rss0 = proc.memory_info().rss
        t0 = time.perf_counter()
        eng.place(bag, cfg)
        place_s = time.perf_counter() - t0
        streamer = eng.states(bag)["transformer"].transport
        out_rows: dict[str, dict] = {}
        if firstk is not None:  # the manual knob: no planner, blocks 0..K-1 resident
            streamer.events.unsubscribe("preload")
            streamer.set_resident(streamer.pieces_of(set(range(firstk))))
        watch = PeakWatch(streamer)
        for w in workloads:
            med, runs, out = run(m, feeds[w], args.warmup, args.repeats, watch)
            loop_s = loop(m, feeds[w], args.repeats)
            watch.sample()
            details = streamer.details()
            ooms, retries = alloc_counts()
            out_rows[w] = row(
                section=label, cap_gib=cap, workload=w, median_s=med, runs=runs, loop_s=loop_s,
                rel_err=rel_err(out, refs[w]), peak_alloc_gib=watch.alloc / GiB, peak_reserved_gib=watch.reserved / GiB,
                free_at_start_gib=free0 / GiB, pinned_gib=pinned_bytes() / GiB, rss_gib=proc.memory_info().rss / GiB,
                rss_growth_gib=(proc.memory_info().rss - rss0) / GiB, place_s=place_s, kept=details.get("kept", 0),
                kept_gib=streamer.kept_bytes() / GiB, plan=details.get("plan", ""),
                streamed_gib=streamer.streamed_bytes() / GiB, alloc_retries=retries, ooms=ooms,
                ooms_met_by_engine=streamer.ooms,
                expandable_by_engine=getattr(engine_memory, "_expandable_turned_on", None))
            del out
            if out_rows[w]["rel_err"] > 1e-3:
                raise SystemExit(f"{label} {w}: output differs from resident ({out_rows[w]['rel_err']:.3g})")
    finally:
        eng.release(bag)
        hold.close()
    assert pinned_bytes() == 0, "release left pinned memory"
    return out_rows


def section_modes(args) -> None:
    m = build_wan(args.mode_blocks, DEV, args.tiny)
    feeds = {w: wan_inputs(w, args.frames, DEV) for w in ("small", "video")}
    refs = {}
    for w in feeds:
        med, runs, refs[w] = run(m, feeds[w], 1, args.repeats)
        row(section="modes", mode="resident(no engine)", workload=w, median_s=med, runs=runs, rel_err=0.0,
            peak_alloc_gib=peak_alloc_gib(), blocks=args.mode_blocks)
    to_host(m)
    for mode in ("auto", "model", "leaf", "none"):
        eng, bag = Engine(), Components(transformer=m)
        t0 = time.perf_counter()
        eng.place(bag, on_dev(mode=mode, preload="off", on_demand_threshold_gb=0))
        place_s = time.perf_counter() - t0
        for w in feeds:
            med, runs, out = run(m, feeds[w], 1, args.repeats)
            eng.after_run(bag)
            row(section="modes", mode=mode, workload=w, median_s=med, runs=runs, rel_err=rel_err(out, refs[w]),
                peak_alloc_gib=peak_alloc_gib(), pinned_gib=pinned_bytes() / GiB,
                place_s=place_s, blocks=args.mode_blocks)
        eng.release(bag)
    del m
    gc.collect()
    torch.cuda.empty_cache()


def strip_group_offloading(m: torch.nn.Module) -> None:
    """Remove diffusers' group-offloading hooks (diffusers 0.42.1 has no public remove)."""
    for module in m.modules():
        registry = module.__dict__.get("_diffusers_hook")
        if registry is None:
            continue
        for name in DIFFUSERS_GROUP_HOOKS:
            registry.remove_hook(name, recurse=False)
        if not registry.hooks:
            del module._diffusers_hook
            module.__dict__.pop("forward", None)


def section_anchors(m, refs, feeds, args) -> None:
    from diffusers.hooks import apply_group_offloading

    for kind in ("block_level", "leaf_level"):
        kw = {"num_blocks_per_group": 1} if kind == "block_level" else {}
        t0 = time.perf_counter()
        apply_group_offloading(m, onload_device=torch.device(DEV), offload_device=torch.device("cpu"),
                               offload_type=kind, use_stream=DEV == "cuda", **kw)
        apply_s = time.perf_counter() - t0
        for w in feeds:
            med, runs, out = run(m, feeds[w], args.warmup, args.repeats)
            row(section="anchor", mode=f"diffusers {kind}+stream", workload=w, median_s=med, runs=runs,
                rel_err=rel_err(out, refs[w]), peak_alloc_gib=peak_alloc_gib(),
                rss_gib=psutil.Process().memory_info().rss / GiB, place_s=apply_s)
        strip_group_offloading(m)
        gc.collect()
        if cuda_used():
            torch._C._host_emptyCache()
            torch.cuda.empty_cache()


def section_mmgp(m, refs, feeds, args, cap: float | None) -> None:
    """mmgp 3.8.2 as WanGP runs it: pinned, async transfers, no quantization, fp32 modules kept
    fp32 (as ours), ``--mmgp-kept`` blocks preloaded. Its budget (MiB) buys blocks as
    ``int((budget - non-block - 2 * block) / block)`` (``offload.tune_preloading``), so the budget
    for K blocks is asked with one MiB to spare, and the row reports the count mmgp actually kept.
    Last in the process: mmgp moves the weights into its own pinned chunks and leaves them there."""
    from mmgp import offload

    # As WanGP declares mixed precision to mmgp (which asserts one dtype otherwise): the model's
    # dtype, and the modules kept in fp32 locked to it.
    m._model_dtype = torch.bfloat16
    for sub in m.modules():
        if any(p.dtype == torch.float32 for p in sub.parameters(recurse=False)):
            sub._lock_dtype = torch.float32
    block = max(nbytes(b) for b in m.blocks)
    budget_mib = (nbytes(m) - sum(nbytes(b) for b in m.blocks) + (args.mmgp_kept + 2) * block) / 2**20 + 1
    ballast = Ballast(cap)
    try:
        t0 = time.perf_counter()
        mm = offload.all({"transformer": m}, pinnedMemory=True, quantizeTransformer=False, asyncTransfers=True,
                         budgets={"transformer": budget_mib}, convertWeightsFloatTo=None, verboseLevel=1)
        place_s = time.perf_counter() - t0
        kept = len(mm.preloaded_blocks_per_model["transformer"])
        for w in feeds:
            try:
                med, runs, out = run(m, feeds[w], args.warmup, args.repeats)
                row(section="mmgp", cap_gib=cap, workload=w, median_s=med, runs=runs, rel_err=rel_err(out, refs[w]),
                    kept=kept, asked=args.mmgp_kept, budget_mib=budget_mib, place_s=place_s,
                    peak_alloc_gib=torch.cuda.max_memory_allocated() / GiB,
                    peak_reserved_gib=torch.cuda.max_memory_reserved() / GiB,
                    rss_gib=psutil.Process().memory_info().rss / GiB)
                del out
            except torch.OutOfMemoryError as e:
                row(section="mmgp", cap_gib=cap, workload=w, kept=kept, error=f"OOM: {str(e)[:100]}")
                gc.collect()
                torch.cuda.empty_cache()
        mm.release()
    finally:
        ballast.close()


def section_cycles(m, refs, feeds, args, cap: float) -> None:
    hold = ballast(cap)
    eng, bag = Engine(), Components(transformer=m)
    eng.place(bag, config(args, preload="auto"))
    streamer = eng.states(bag)["transformer"].transport
    plans, per_cycle = [], []
    ooms0, retries0 = alloc_counts()
    if cuda_used():
        torch.cuda.reset_peak_memory_stats()
    watch = PeakWatch(streamer)
    worst = 0.0
    for i in range(args.cycles):
        w = "small" if i % 2 == 0 else "video"
        before = (*alloc_counts(), streamer.ooms)
        out = wan_forward(m, *feeds[w])
        sync()
        worst = max(worst, rel_err(out, refs[w]))
        line = streamer.details()["plan"]
        if not plans or plans[-1] != line:
            plans.append(line)
        alloc, reserved = watch.take()
        ooms, retries = alloc_counts()
        per_cycle.append(dict(workload=w, kept=len(streamer.resident_blocks()), kept_gib=round(streamer.kept_bytes() / GiB, 2),
                              peak_alloc_gib=round(alloc, 3), peak_reserved_gib=round(reserved, 3),
                              ooms=ooms - before[0], retries=retries - before[1],
                              ooms_met_by_engine=streamer.ooms - before[2]))
        del out
    ooms, retries = alloc_counts()
    row(section="cycles", cap_gib=cap, cycles=args.cycles, ooms=ooms - ooms0,
        ooms_met_by_engine=sum(c["ooms_met_by_engine"] for c in per_cycle), retries=retries - retries0,
        peak_reserved_gib=watch.reserved / GiB, peak_alloc_gib=watch.alloc / GiB, worst_rel_err=worst, plans=plans,
        per_cycle=per_cycle)
    eng.release(bag)
    hold.close()


def main() -> None:
    global row, DEV
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="modes,stream,preload,firstk,anchors,cycles")
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--mode-blocks", type=int, default=4)
    ap.add_argument("--frames", type=int, default=21, help="latent frames of the video workload (21 = 81 frames)")
    ap.add_argument("--caps", default="12,24,48")
    ap.add_argument("--no-firstk-video", action="store_true", help="first-K rows for the small workload only")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--workloads", default="small,video")
    ap.add_argument("--whole-blocks", action="store_true", help="engine rows stream each block whole")
    ap.add_argument("--window", type=int, default=1, help="prefetch window of the engine rows")
    ap.add_argument("--mmgp-kept", type=int, default=0, help="blocks mmgp keeps (mmgp section)")
    ap.add_argument("--debug", action="store_true", help="the planner's fit lines (DEBUG)")
    ap.add_argument("--self-check", action="store_true", help="check the table's ratios on hand-made rows (CPU)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU dry run: 2 blocks of width 128, 1 latent frame, no ballast, preload a one-block budget")
    output_args(ap)
    args = ap.parse_args()
    row = open_output(args, "wan_bench")
    if args.tiny:
        DEV, args.blocks, args.mode_blocks, args.frames = "cpu", min(args.blocks, 2), min(args.mode_blocks, 2), 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.debug:
        logging.getLogger("diffusers_offload.preload").setLevel(logging.DEBUG)
    sections = args.sections.split(",")
    caps = [float(c) for c in args.caps.split(",") if c]
    workloads = tuple(args.workloads.split(","))
    import diffusers

    cuda = DEV == "cuda"
    row(section="env", gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
        diffusers=diffusers.__version__, h2d_pinned_gbs=h2d_bandwidth() / GB if cuda else None,
        host_total_gib=psutil.virtual_memory().total / GiB,
        allocator=torch.cuda.get_allocator_backend() if cuda else None, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        stream_parts=not args.whole_blocks, window=args.window, args=vars(args))
    if "modes" in sections:
        section_modes(args)
    if set(sections) - {"modes"}:
        main_model(args, sections, caps, workloads)
    row.save()
    print(side_by_side(row.rows), flush=True)


def main_model(args, sections, caps, workloads) -> None:
    m = build_wan(args.blocks, DEV, args.tiny)
    args.tiny_budget_gib = nbytes(m.blocks[0]) * 1.5 / GiB
    feeds = {w: wan_inputs(w, args.frames, DEV) for w in workloads}
    refs = {}
    for w in workloads:
        med, runs, refs[w] = run(m, feeds[w], 1, args.repeats)
        row(section="resident", workload=w, median_s=med, runs=runs, loop_s=loop(m, feeds[w], args.repeats),
            weights_gib=nbytes(m) / GiB, peak_alloc_gib=peak_alloc_gib())
    row(section="to_host", seconds=to_host(m), rss_gib=psutil.Process().memory_info().rss / GiB)
    if "stream" in sections:
        run_engine("stream", m, config(args, preload="off"), None, refs, feeds, args, workloads=workloads)
    for cap in caps:
        if "preload" in sections:
            auto = run_engine("preload_auto", m, config(args, preload="auto"), cap, refs, feeds, args,
                              workloads=workloads)
        if "firstk" in sections:
            firstk_rows(m, cap, auto, refs, feeds, args)
    if "cycles" in sections and caps:
        section_cycles(m, refs, feeds, args, min(caps))
    if "anchors" in sections:
        section_anchors(m, refs, feeds, args)
    if "mmgp" in sections:
        section_mmgp(m, refs, feeds, args, caps[0] if caps else None)


if __name__ == "__main__":
    main()

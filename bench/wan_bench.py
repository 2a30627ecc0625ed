"""Wan-2.1-14B (or FLUX.1-dev) geometry transformer, random bf16 weights, under the engine and the anchors, side by side.

One process, one model: it is built on the GPU (benchkit.models), timed resident, moved to pageable
host memory, then placed and released per row. Smaller cards are imitated with a ballast process
made before each capped row (benchkit.measure.Ballast), so the planner sees the free memory such a
card would report. Each timed forward is synchronize -> perf_counter -> forward -> synchronize; the
median of ``--repeats`` after ``--warmup`` forwards. Parity is against the resident output of the
same process. Every engine row also counts its sync loads: streamed units its side stream had not
copied ahead when a block asked for them (the streamer's ``details()["sync_loads"]``), in its first
forward, its warm-ups and its timed forwards; after the first forward (the one whose order is learnt)
the count should not grow. The run ends with the side-by-side table (benchkit.table).

``--model flux`` runs the same rows on a FLUX.1-dev transformer (two towers: 19 dual-stream and 38
single-stream blocks), ``--model zimage`` on Z-Image Turbo's (30 layers) and ``--model qwenimage`` on
Qwen-Image's (60 blocks; the configs the pack carries), one 1024x1024 image workload, and writes ``wan_bench_<model>.json``/``.log``.

    python bench/wan_bench.py --sections stream,preload --caps 12,24 --out $OUT   # the headline rows
    python bench/wan_bench.py --self-check                                        # CPU: the table's ratios
    python bench/wan_bench.py --tiny --sections stream,preload,firstk,cycles,anchors --caps 12  # CPU dry run
    python bench/wan_bench.py --model flux --sections stream,preload --caps 12,24 --out $OUT  # Flux rows

Sections:
  modes    every engine mode on a short model (--mode-blocks): parity, step time, peak VRAM
  stream   full streaming (preload off): small and video, against the bound
  preload  preload auto at each cap
  firstk   hand-picked "first K blocks resident" at each cap (the manual knob users set today)
  anchors  diffusers block_level+stream and leaf_level+stream
  cycles   30 cycles alternating the workloads at the tightest cap: OOMs, peak, plan lines, sync loads
  mmgp     mmgp 3.8.2 (WanGP's engine) keeping --mmgp-kept blocks at the first cap; runs last, and
           needs ``mmgp`` and ``optimum-quanto`` (carry their wheels: the GPU machine has no network)
With ``--model flux`` / ``zimage`` / ``qwenimage``: stream, preload, cycles and anchors.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import logging
import os
import sys
import time

from benchkit import GB, GiB, Rows, open_output, output_args, pack
from benchkit.anchors import section_anchors, section_mmgp
from benchkit.table import self_check, side_by_side

if "--self-check" in sys.argv:  # no torch, no GPU
    sys.exit(self_check())

import psutil  # noqa: E402
import torch  # noqa: E402
from benchkit import storages  # noqa: E402
from benchkit.image_models import IMAGE_MODELS  # noqa: E402
from benchkit.measure import (  # noqa: E402
    GC,
    Ballast,
    PeakWatch,
    SyncLoads,
    alloc_counts,
    cuda_used,
    h2d_bandwidth,
    launch_and_step,
    peak_alloc_gib,
    python_speed_ms,
    rel_err,
    sync,
    timed,
    to_host,
)
from benchkit.models import FP8_STORAGES, blocks_of, build_wan, nbytes, wan_forward, wan_inputs  # noqa: E402

pack()
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core import memory as engine_memory  # noqa: E402
from diffusers_offload.offload_core.pinning import pinned_bytes  # noqa: E402

row = Rows()
DEV = "cuda"  # "cpu" with --tiny: the dry run that checks the flow, not the speed
FORWARD = wan_forward  # the image model's with --model flux / zimage / qwenimage
WAN_ONLY = {"modes", "firstk", "mmgp"}
GRAPHED_AFTER = 3  # forwards before a graphed step: the first, the eager one graph_worth times, the capture


def run(m, feeds, warmup, repeats, watch=None, after=None):
    return timed(lambda: FORWARD(m, *feeds), warmup, repeats, watch, after)


def host_times(m, feeds, repeats: int) -> dict:
    """The back-to-back loop's step; one synchronized forward's launch and step (equal: host-bound);
    the host's pure-Python speed right after: it drifts within a process (bench/README.md, run 28)."""
    launch_s, step_s, loop_s = launch_and_step(lambda: FORWARD(m, *feeds), repeats)
    return dict(loop_s=loop_s, launch_s=launch_s, launch_step_s=step_s, python_ms=round(python_speed_ms(), 1))


def build(args):
    """The model; with ``--storage fp8_*`` its Linear weights stored as the loader's fp8 dtypes do."""
    image = IMAGE_MODELS.get(args.model)
    m = image.build(DEV, args.tiny) if image else build_wan(args.blocks, DEV, args.tiny)
    storages.apply(m, args.storage, row, args.cast_each_forward)
    return m


def resident(m, feeds: dict, args) -> dict:
    """The resident reference rows; their outputs are the parity references. fp8 storage has no
    plain resident forward, nor ``--compile`` a plain compiled one: the engine keeps every block on
    the device, so the reference runs the same path (casts, compiled forwards) as the streamed rows."""
    refs = {}
    eng = bag = None
    if args.storage in storages.CAST or args.compile:
        eng, bag = Engine(), Components(transformer=m)
        eng.place(bag, config(args, preload="1000"))
    for w, feed in feeds.items():
        med, runs, refs[w] = run(m, feed, GRAPHED_AFTER, args.repeats)
        row(section="resident", workload=w, median_s=med, runs=runs, **host_times(m, feed, args.repeats),
            weights_gib=nbytes(m) / GiB, peak_alloc_gib=peak_alloc_gib(), storage=args.storage,
            kept_gib=eng.states(bag)["transformer"].transport.kept_bytes() / GiB if eng else None, **GC.last)
    if eng is not None:
        eng.release(bag)
    if args.storage in FP8_STORAGES:
        layerwise(m, feeds, refs, args)
    return refs


def layerwise(m, feeds: dict, refs: dict, args) -> None:
    """Calibration for fp8: the model resident with a dequantising hook per layer (mode none):
    its step, and its output against the per-unit cast path's (the same formula: expect 0)."""
    eng, bag = Engine(), Components(transformer=m)
    eng.place(bag, on_dev(mode="none"))
    try:
        for w, feed in feeds.items():
            med, runs, out = run(m, feed, 1, args.repeats)
            row(section="resident_layerwise", workload=w, median_s=med, runs=runs, rel_err=rel_err(out, refs[w]),
                bit_equal=bool(torch.equal(out, refs[w])), peak_alloc_gib=peak_alloc_gib())
            del out
    finally:
        eng.release(bag)


def inputs(args, w: str) -> tuple:
    image = IMAGE_MODELS.get(args.model)
    return image.inputs(w, DEV, args.tiny) if image else wan_inputs(w, args.frames, DEV)


def config(args, **kw) -> OffloadConfig:
    """The engine's config for a row: ``--whole-blocks`` streams each block whole; ``--window``
    sets the prefetch window (the ring holds window + 1 of the largest unit). The CPU dry run has
    no ballast: preload auto becomes a fixed budget of about one block."""
    if DEV == "cpu" and kw.get("preload") == "auto":
        kw["preload"] = args.tiny_budget_gib
    return on_dev(stream_parts=not args.whole_blocks, prefetch_window=args.window, compile_blocks=args.compile, **kw)


def on_dev(**kw) -> OffloadConfig:
    if DEV == "cpu":
        kw = dict(kw, device="cpu", on_demand_threshold_gb=0, resident_floor_mb=0)
    return OffloadConfig(**kw)


def ballast(cap: float | None) -> Ballast:
    return Ballast(cap if DEV == "cuda" else None)


def free_now() -> tuple[int, int]:  # (card free, this process's live bytes: in a row's peak, not in free)
    return (torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated()) if DEV == "cuda" else (0, 0)


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
    free0, live0 = free_now()
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
            loads = SyncLoads(streamer)
            med, runs, out = run(m, feeds[w], args.warmup, args.repeats, watch, loads.mark)
            gc_timed, host = GC.last, host_times(m, feeds[w], args.repeats)
            loads.mark()
            watch.sample()
            details = streamer.details()
            ooms, retries = alloc_counts()
            out_rows[w] = row(
                section=label, cap_gib=cap, workload=w, median_s=med, runs=runs,
                rel_err=rel_err(out, refs[w]), peak_alloc_gib=watch.alloc / GiB, peak_reserved_gib=watch.reserved / GiB,
                free_at_start_gib=free0 / GiB, live_at_start_gib=live0 / GiB, cached_at_start_gib=hold.cached / GiB, pinned_gib=pinned_bytes() / GiB, rss_gib=proc.memory_info().rss / GiB,
                rss_growth_gib=(proc.memory_info().rss - rss0) / GiB, place_s=place_s, kept=details.get("kept", 0),
                kept_gib=streamer.kept_bytes() / GiB, plan=details.get("plan", ""), units=details.get("units"),
                streamed_gib=streamer.streamed_bytes() / GiB, held_gib=details.get("held_bytes", 0) / GiB,
                graphs=details.get("graphs"), graphs_aside=details.get("graphs_aside"), compiled_calls=details.get("compiled_calls"), alloc_retries=retries, ooms=ooms, ooms_met_by_engine=streamer.ooms,
                expandable_by_engine=getattr(engine_memory, "_expandable_turned_on", None),
                **loads.fields(args.warmup, args.repeats), **gc_timed, **host)
            del out
            if out_rows[w]["rel_err"] > (2e-2 if args.compile else 1e-3):  # blocks streamed part by part run eagerly
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
            loads = SyncLoads(eng.states(bag)["transformer"].transport)
            med, runs, out = run(m, feeds[w], 1, args.repeats, after=loads.mark)
            eng.after_run(bag)
            row(section="modes", mode=mode, workload=w, median_s=med, runs=runs, rel_err=rel_err(out, refs[w]),
                peak_alloc_gib=peak_alloc_gib(), pinned_gib=pinned_bytes() / GiB,
                place_s=place_s, blocks=args.mode_blocks, **loads.fields(1, args.repeats))
        eng.release(bag)
    del m
    gc.collect()
    torch.cuda.empty_cache()


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
    loads = SyncLoads(streamer)
    for i in range(args.cycles):
        w = list(feeds)[i % len(feeds)]
        before = (*alloc_counts(), streamer.ooms)
        out = FORWARD(m, *feeds[w])
        loads.mark()
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
                              ooms_met_by_engine=streamer.ooms - before[2], sync_loads=loads.delta(i, i + 1)))
        del out
    ooms, retries = alloc_counts()
    row(section="cycles", cap_gib=cap, cycles=args.cycles, ooms=ooms - ooms0,
        ooms_met_by_engine=sum(c["ooms_met_by_engine"] for c in per_cycle), retries=retries - retries0,
        peak_reserved_gib=watch.reserved / GiB, peak_alloc_gib=watch.alloc / GiB, worst_rel_err=worst, plans=plans,
        sync_loads_first=loads.delta(0, 1), sync_loads_after_first=loads.delta(1, args.cycles),
        sync_side_stream=loads.side_stream, per_cycle=per_cycle)
    eng.release(bag)
    hold.close()


def main() -> None:
    global row, DEV, FORWARD
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("wan", *IMAGE_MODELS), default="wan",
                    help="flux: the FLUX.1-dev transformer (two towers), zimage / qwenimage / flux2 / klein9b: "
                         "Z-Image Turbo's / Qwen-Image's / FLUX.2 [dev]'s / [klein] 9B's (the carried configs); "
                         "qwenedit: Qwen-Image-Edit-2511's with one reference image; workload image (1024x1024)")
    ap.add_argument("--sections", default="", help="default: modes,stream,preload,firstk,anchors,cycles "
                    "(flux: stream,preload,anchors,cycles)")
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--mode-blocks", type=int, default=4)
    ap.add_argument("--frames", type=int, default=21, help="latent frames of the video workload (21 = 81 frames)")
    ap.add_argument("--caps", default="12,24,48")
    ap.add_argument("--no-firstk-video", action="store_true", help="first-K rows for the small workload only")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--workloads", default="", help="default: small,video (flux: image)")
    ap.add_argument("--whole-blocks", action="store_true", help="engine rows stream each block whole")
    ap.add_argument("--storage", choices=storages.STORAGES, default="bf16", help=storages.HELP)
    ap.add_argument("--cast-each-forward", action="store_true", help="fp8: no kept piece held as compute values")
    ap.add_argument("--window", type=int, default=1, help="prefetch window of the engine rows")
    ap.add_argument("--compile", action="store_true", help="engine rows (and the resident reference) compile_blocks")
    ap.add_argument("--mmgp-kept", type=int, default=0, help="blocks mmgp keeps (mmgp section)")
    ap.add_argument("--debug", action="store_true", help="the planner's fit lines (DEBUG)")
    ap.add_argument("--self-check", action="store_true", help="check the table's ratios on hand-made rows (CPU)")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: 2 blocks of width 128 (flux: 2 + 2, a 128x128 "
                    "image), 1 latent frame, no ballast, preload a one-block budget")
    output_args(ap)
    args = ap.parse_args()
    image = args.model != "wan"
    args.sections = args.sections or ("stream,preload,anchors,cycles" if image else "modes,stream,preload,firstk,anchors,cycles")
    args.workloads = args.workloads or ("image" if image else "small,video")
    if image and WAN_ONLY & set(args.sections.split(",")):
        ap.error(f"--model {args.model} runs no {', '.join(sorted(WAN_ONLY & set(args.sections.split(','))))} section")
    FORWARD = IMAGE_MODELS[args.model].forward if image else wan_forward
    name = f"wan_bench_{args.model}" if image else "wan_bench"
    row = open_output(args, name if args.storage == "bf16" else f"{name}_{args.storage}")
    if args.tiny:
        DEV, args.blocks, args.mode_blocks, args.frames = "cpu", min(args.blocks, 2), min(args.mode_blocks, 2), 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.debug:
        logging.getLogger("diffusers_offload.preload").setLevel(logging.DEBUG)
    sections = args.sections.split(",")
    caps = [float(c) for c in args.caps.split(",") if c]
    workloads = tuple(args.workloads.split(","))
    cuda = DEV == "cuda"
    row(section="env", gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
        diffusers=importlib.metadata.version("diffusers"), h2d_pinned_gbs=h2d_bandwidth() / GB if cuda else None,
        host_total_gib=psutil.virtual_memory().total / GiB, python_speed_ms=python_speed_ms(),
        allocator=torch.cuda.get_allocator_backend() if cuda else None, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        stream_parts=not args.whole_blocks, window=args.window, model=args.model, storage=args.storage, args=vars(args))
    if "modes" in sections:
        section_modes(args)
    if set(sections) - {"modes"}:
        main_model(args, sections, caps, workloads)
    row.save()
    print(side_by_side(row.rows), flush=True)


def main_model(args, sections, caps, workloads) -> None:
    m = build(args)
    blocks = blocks_of(m)
    args.tiny_budget_gib = max(nbytes(b) for b in blocks) * 1.5 / GiB
    row(section="model", model=type(m).__name__, params=sum(p.numel() for p in m.parameters()),
        weights_gib=nbytes(m) / GiB, blocks=len(blocks), non_block_gib=(nbytes(m) - sum(map(nbytes, blocks))) / GiB,
        block_gib=sorted({round(nbytes(b) / GiB, 4) for b in blocks}))
    feeds = {w: inputs(args, w) for w in workloads}
    refs = resident(m, feeds, args)
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
        section_anchors(m, refs, feeds, args, run, row, DEV)
    if "mmgp" in sections:
        section_mmgp(m, refs, feeds, args, caps[0] if caps else None, run, row)


if __name__ == "__main__":
    main()

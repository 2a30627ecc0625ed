"""Wan-2.1-14B-geometry transformer (random bf16 weights) under the engine and the anchors, side by side.

One process, one model: it is built on the GPU (seed 0, bf16 except ``_keep_in_fp32_modules``, as
``from_pretrained`` does), timed resident, moved to pageable host memory, then placed and released
per row. Smaller cards are imitated with a *ballast* allocation made before each capped row, so the
planner sees the free memory such a card would report. Each timed forward is synchronize ->
perf_counter -> forward -> synchronize; the median of ``--repeats`` after ``--warmup`` forwards.

    python bench/wan_bench.py --sections modes,stream,preload,firstk,anchors,cycles --json $OUT/r.json

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
import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
if "diffusers_offload" not in sys.modules:  # import the pack without putting the repo root on sys.path
    _spec = importlib.util.spec_from_file_location("diffusers_offload", ROOT / "__init__.py",
                                                   submodule_search_locations=[str(ROOT)])
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["diffusers_offload"] = _mod
    _spec.loader.exec_module(_mod)

from bench_table import side_by_side  # noqa: E402
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core import memory as engine_memory  # noqa: E402
from diffusers_offload.offload_core.pinning import pinned_bytes  # noqa: E402

GB, GiB = 1e9, 2**30
WAN14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
              out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
              cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
WORKLOADS = {"small": (1, 16, 1, 64, 64), "video": (1, 16, 21, 60, 104)}
DEV = torch.device("cuda")
ROWS: list[dict] = []
log = logging.getLogger("bench")


def build(blocks: int) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with DEV:
        m = WanTransformer3DModel(**dict(WAN14B, num_layers=blocks))
    keep = set(m._keep_in_fp32_modules or [])
    for n, p in m.named_parameters():
        if not any(k in n.split(".") for k in keep):
            p.data = p.data.to(torch.bfloat16)
    return m.eval().requires_grad_(False)


def inputs(name: str, frames: int) -> tuple:
    shape = list(WORKLOADS[name])
    if name == "video":
        shape[2] = frames
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(shape, generator=g, device=DEV, dtype=torch.bfloat16)
    enc = torch.randn((1, 512, 4096), generator=g, device=DEV, dtype=torch.bfloat16)
    return x, enc, torch.full((1,), 500.0, device=DEV)


def forward(m, x, enc, t) -> torch.Tensor:
    with torch.inference_mode():
        return m(hidden_states=x, encoder_hidden_states=enc, timestep=t, return_dict=False)[0]


def sync() -> None:
    """Wait for the device (a no-op on the CPU, where the companion benches smoke-test)."""
    if DEV.type == "cuda":
        torch.cuda.synchronize()


class PeakWatch:
    """The process's allocator peaks over many forwards. The engine's planner resets torch's peak
    statistics when a forward begins and at its first block, so the watch reads them just before
    each reset (as the streamer's first listener) and after each forward (``take``/``sample``).
    The reading at a forward's start covers the time since the last forward ended (the bench's
    own work): it counts for the whole run, not for the forward that begins."""

    def __init__(self, streamer=None) -> None:
        self.alloc = self.reserved = 0  # since the watch began
        self.interval = (0, 0)  # (alloc, reserved) since the last ``take``
        if streamer is not None and hasattr(streamer, "listeners"):
            streamer.listeners.insert(0, self._on_event)

    def _on_event(self, event: str, streamer, **info) -> bool:
        if event in ("forward", "cycle"):
            self.sample(interval=event == "cycle")
        return False

    def sample(self, interval: bool = True) -> None:
        if DEV.type != "cuda":
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


def timed(m, feeds, warmup: int, repeats: int, watch: PeakWatch | None = None
          ) -> tuple[float, list[float], torch.Tensor]:
    """The peak statistics are reset once, before the warm-up; ``watch`` samples them around the
    planner's own resets."""
    sync()
    if DEV.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    watch = watch or PeakWatch()
    watch.alloc = watch.reserved = 0
    for _ in range(warmup):
        out = forward(m, *feeds)
        watch.sample()
    runs = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = forward(m, *feeds)
        sync()
        runs.append(time.perf_counter() - t0)
        watch.sample()
    return statistics.median(runs), runs, out


def loop_time(m, feeds, repeats: int) -> float:
    """The mean step of ``repeats`` forwards queued back to back with one synchronize at the end,
    as a sampling loop runs them: the host's work at a forward's start then overlaps the last
    forward's GPU work, where ``timed`` leaves the GPU waiting for it."""
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        forward(m, *feeds)
    sync()
    return (time.perf_counter() - t0) / repeats


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def to_host(m: torch.nn.Module) -> float:
    t0 = time.perf_counter()
    for t in (*m.parameters(), *m.buffers()):
        t.data = t.data.to("cpu")
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


def h2d_bandwidth() -> float:
    src = torch.empty(GiB, dtype=torch.uint8).pin_memory()
    dst = torch.empty(GiB, dtype=torch.uint8, device=DEV)
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


class Ballast:
    """A second process holds device memory so that only ``cap`` GiB stay free: the engine then
    reads the free memory a smaller card would report, and its own allocator peak stays its own."""

    CODE = ("import sys, torch; n = int(sys.argv[1]); x = torch.empty(n, dtype=torch.uint8, device='cuda'); "
            "print('held', flush=True); sys.stdin.read()")

    def __init__(self, cap_gib: float | None) -> None:
        self.proc = None
        if cap_gib:
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0]
            hold = int(free - cap_gib * GiB - 600 * 2**20)  # the holder's own CUDA context ~0.5 GiB
            self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(hold)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
            assert self.proc.stdout.readline().strip() == "held"
            log.info("ballast holds %.1f GiB: %.1f GiB free", hold / GiB, torch.cuda.mem_get_info()[0] / GiB)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()
        torch.cuda.empty_cache()


def config(args, **kw) -> OffloadConfig:
    """The engine's config for a row: ``--whole-blocks`` streams each block whole; ``--window``
    sets the prefetch window (the ring holds window + 1 of the largest unit)."""
    return OffloadConfig(**{"stream_parts": not args.whole_blocks, "prefetch_window": args.window, **kw})


def row(**kw) -> dict:
    ROWS.append(kw)
    print(json.dumps(kw), flush=True)
    return kw


def firstk_rows(m, cap, auto: dict[str, dict], refs, feeds, args) -> None:
    """The manual knob around what the planner chose: small at K-2, K, K+2; video at its K. K is
    the whole blocks the plan's kept bytes would buy (it keeps pieces: block cores first)."""
    block = sum(t.numel() * t.element_size() for t in (*m.blocks[0].parameters(), *m.blocks[0].buffers()))
    kept = {w: round(r["kept_gib"] * GiB / block) for w, r in auto.items()}
    ks = sorted({max(0, kept["small"] + d) for d in (-2, 0, 2)})  # K=0 is the stream row
    for k in ks:
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
    ballast = Ballast(cap)
    free0 = torch.cuda.mem_get_info()[0]
    eng = Engine()
    bag = Components(transformer=m)
    try:
        rss0 = psutil.Process().memory_info().rss
        t0 = time.perf_counter()
        eng.place(bag, cfg)
        place_s = time.perf_counter() - t0
        streamer = eng.states(bag)["transformer"].transport
        out_rows: dict[str, dict] = {}
        if firstk is not None:  # the manual knob: no planner, blocks 0..K-1 resident
            streamer.listeners.clear()
            streamer.set_resident(streamer.pieces_of(set(range(firstk))))
        watch = PeakWatch(streamer)
        for w in workloads:
            med, runs, out = timed(m, feeds[w], args.warmup, args.repeats, watch)
            loop = loop_time(m, feeds[w], args.repeats)
            watch.sample()
            kept = streamer.details().get("kept", 0) if hasattr(streamer, "details") else 0
            kept_bytes = getattr(streamer, "kept_bytes", lambda: 0)()
            out_rows[w] = row(section=label, cap_gib=cap, workload=w, median_s=med, runs=runs, loop_s=loop, rel_err=rel_err(out, refs[w]),
                peak_alloc_gib=watch.alloc / GiB, peak_reserved_gib=watch.reserved / GiB, free_at_start_gib=free0 / GiB,
                pinned_gib=pinned_bytes() / GiB, rss_gib=psutil.Process().memory_info().rss / GiB,
                rss_growth_gib=(psutil.Process().memory_info().rss - rss0) / GiB, place_s=place_s,
                kept=kept, kept_gib=kept_bytes / GiB, plan=streamer.details().get("plan", ""),
                streamed_gib=getattr(streamer, "streamed_bytes", lambda: 0)() / GiB,
                alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0),
                ooms=torch.cuda.memory_stats().get("num_ooms", 0), ooms_met_by_engine=getattr(streamer, "ooms", 0),
                expandable_by_engine=engine_memory._expandable_turned_on)
            del out
            if out_rows[w]["rel_err"] > 1e-3:
                raise SystemExit(f"{label} {w}: output differs from resident ({out_rows[w]['rel_err']:.3g})")
    finally:
        eng.release(bag)
        ballast.close()
    assert pinned_bytes() == 0, "release left pinned memory"
    return out_rows


def section_modes(args) -> None:
    m = build(args.mode_blocks)
    feeds = {w: inputs(w, args.frames) for w in ("small", "video")}
    refs = {}
    for w in feeds:
        med, runs, refs[w] = timed(m, feeds[w], 1, args.repeats)
        row(section="modes", mode="resident(no engine)", workload=w, median_s=med, runs=runs, rel_err=0.0,
            peak_alloc_gib=torch.cuda.max_memory_allocated() / GiB, blocks=args.mode_blocks)
    to_host(m)
    for mode in ("auto", "model", "leaf", "none"):
        cfg = OffloadConfig(mode=mode, preload="off", on_demand_threshold_gb=0)
        eng, bag = Engine(), Components(transformer=m)
        t0 = time.perf_counter()
        eng.place(bag, cfg)
        place_s = time.perf_counter() - t0
        for w in feeds:
            med, runs, out = timed(m, feeds[w], 1, args.repeats)
            eng.after_run(bag)
            row(section="modes", mode=mode, workload=w, median_s=med, runs=runs, rel_err=rel_err(out, refs[w]),
                peak_alloc_gib=torch.cuda.max_memory_allocated() / GiB, pinned_gib=pinned_bytes() / GiB,
                place_s=place_s, blocks=args.mode_blocks)
        eng.release(bag)
    del m
    gc.collect()
    torch.cuda.empty_cache()


def section_anchors(m, refs, feeds, args) -> None:
    from diffusers.hooks import apply_group_offloading
    from diffusers_offload.offload_core.transport.base import DIFFUSERS_GROUP_HOOKS, strip_hooks

    for kind in ("block_level", "leaf_level"):
        kw = {"num_blocks_per_group": 1} if kind == "block_level" else {}
        t0 = time.perf_counter()
        apply_group_offloading(m, onload_device=DEV, offload_device=torch.device("cpu"), offload_type=kind,
                               use_stream=True, **kw)
        apply_s = time.perf_counter() - t0
        for w in feeds:
            med, runs, out = timed(m, feeds[w], args.warmup, args.repeats)
            row(section="anchor", mode=f"diffusers {kind}+stream", workload=w, median_s=med, runs=runs,
                rel_err=rel_err(out, refs[w]), peak_alloc_gib=torch.cuda.max_memory_allocated() / GiB,
                rss_gib=psutil.Process().memory_info().rss / GiB, place_s=apply_s)
        strip_hooks(m, DIFFUSERS_GROUP_HOOKS)
        gc.collect()
        torch._C._host_emptyCache()
        torch.cuda.empty_cache()


def section_mmgp(m, refs, feeds, args, cap: float | None) -> None:
    """mmgp 3.8.2 as WanGP runs it: pinned, async transfers, no quantization, fp32 modules kept
    fp32 (as ours), ``--mmgp-kept`` blocks preloaded. Its budget (MiB) buys blocks as
    ``int((budget - non-block - 2 * block) / block)`` (``offload.tune_preloading``), so the budget
    for K blocks is asked with one MiB to spare, and the row reports the count mmgp actually kept.
    Last in the process: mmgp moves the weights into its own pinned chunks and leaves them there."""
    from mmgp import offload

    def nbytes(mod: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in (*mod.parameters(), *mod.buffers()))

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
                med, runs, out = timed(m, feeds[w], args.warmup, args.repeats)
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
    ballast = Ballast(cap)
    eng, bag = Engine(), Components(transformer=m)
    eng.place(bag, config(args, preload="auto"))
    streamer = eng.states(bag)["transformer"].transport
    stats = torch.cuda.memory_stats
    plans, per_cycle, ooms0, retries0 = [], [], stats().get("num_ooms", 0), stats().get("num_alloc_retries", 0)
    torch.cuda.reset_peak_memory_stats()
    watch = PeakWatch(streamer)
    worst = 0.0
    for i in range(args.cycles):
        w = "small" if i % 2 == 0 else "video"
        before = (stats().get("num_ooms", 0), stats().get("num_alloc_retries", 0), streamer.ooms)
        out = forward(m, *feeds[w])
        torch.cuda.synchronize()
        worst = max(worst, rel_err(out, refs[w]))
        line = streamer.details()["plan"]
        if not plans or plans[-1] != line:
            plans.append(line)
        alloc, reserved = watch.take()
        per_cycle.append(dict(workload=w, kept=len(streamer.resident_blocks()), kept_gib=round(streamer.kept_bytes() / GiB, 2),
                              peak_alloc_gib=round(alloc, 3),
                              peak_reserved_gib=round(reserved, 3), ooms=stats().get("num_ooms", 0) - before[0],
                              retries=stats().get("num_alloc_retries", 0) - before[1],
                              ooms_met_by_engine=streamer.ooms - before[2]))
        del out
    row(section="cycles", cap_gib=cap, cycles=args.cycles, ooms=stats().get("num_ooms", 0) - ooms0,
        ooms_met_by_engine=sum(c["ooms_met_by_engine"] for c in per_cycle),
        retries=stats().get("num_alloc_retries", 0) - retries0, peak_reserved_gib=watch.reserved / GiB,
        peak_alloc_gib=watch.alloc / GiB, worst_rel_err=worst, plans=plans, per_cycle=per_cycle)
    eng.release(bag)
    ballast.close()


def main() -> None:
    ap = argparse.ArgumentParser()
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
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.debug:
        logging.getLogger("diffusers_offload.preload").setLevel(logging.DEBUG)
    sections = args.sections.split(",")
    caps = [float(c) for c in args.caps.split(",") if c]
    workloads = tuple(args.workloads.split(","))
    import diffusers

    row(section="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, diffusers=diffusers.__version__,
        h2d_pinned_gbs=h2d_bandwidth() / GB, host_total_gib=psutil.virtual_memory().total / GiB,
        allocator=torch.cuda.get_allocator_backend(), alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        stream_parts=not args.whole_blocks, window=args.window)
    if "modes" in sections:
        section_modes(args)
    if not set(sections) - {"modes"}:
        return finish(args)
    m = build(args.blocks)
    total = sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
    feeds = {w: inputs(w, args.frames) for w in workloads}
    refs = {}
    for w in workloads:
        med, runs, refs[w] = timed(m, feeds[w], 1, args.repeats)
        row(section="resident", workload=w, median_s=med, runs=runs, loop_s=loop_time(m, feeds[w], args.repeats),
            weights_gib=total / GiB, peak_alloc_gib=torch.cuda.max_memory_allocated() / GiB)
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
    finish(args)


def finish(args) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(ROWS, indent=1))
    print(side_by_side(ROWS), flush=True)


if __name__ == "__main__":
    main()

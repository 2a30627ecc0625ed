"""A Wan 2.2 two-denoiser pipeline through the Generate video node at a 12 GiB card (issue 24's row):
zero OOMs, and each denoiser's step within 1.05 x its bound.

One process boots a real ComfyUI as its ``main.py`` does (DynamicVRAM on when a GPU is present;
benchkit.comfy.start_host), a ballast process makes the card ``--cap`` GiB in all, and one prompt runs
twice through ComfyUI's executor (run 2 is the timed one):

  Offload settings (preload auto) -> Load diffusers pipeline (bf16) -> Generate video

The pipeline is Wan 2.2 T2V-A14B at the 14B width with ``--layers`` blocks in each denoiser
(``transformer`` above the boundary timestep, ``transformer_2`` below it; boundary_ratio 0.875),
UMT5-XXL with 2 layers, the Wan 2.1 VAE; random bf16 weights written by a build process
(benchkit/wan22.py) and reused while stamped. A second process times each denoiser resident on the
run's shapes. Per denoiser: every forward, bytes streamed per step, kept bytes, sync loads, OOMs,
retries, and the bound max(resident step, streamed bytes / pinned H2D). JSON lines go to ``--json``.

GPU (carry .gpu and .whl; install as bench/comfy_coexist.sh run does):
    python3 bench/wan22_node.py --comfy-dir .gpu/comfyui --cap 12 --layers 10 --json $OUT/wan22_node.jsonl
ComfyUI's default allocator is cudaMallocAsync; ``--comfy-args=--disable-cuda-malloc`` gives the native
one, on which the engine turns expandable segments on (bench/README.md, "The allocator").
CPU smoke (the harness's --cpu start-up, the suite's tiny A14B fixture, no ballast):
    .venv/bin/python bench/wan22_node.py --cpu --tiny --comfy-dir <ComfyUI tree>
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Nothing here may import torch before ComfyUI's start-up has run (cuda_malloc picks the allocator).
import benchkit.comfy as bc
from benchkit import ROOT, GiB, gib
from benchkit.comfy_run import comfy_tree, offline, queue, require_nodes, rerun_json
from benchkit.wan22 import DENOISERS, latent_shape

PIPE_NAME = "wan22_a14b_bench"
ANCHOR_DIRS = (ROOT / ".gpu" / "native_anchor", ROOT.parent / "shared" / "reference" / "native_anchor")
STAMP_VERSION = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--comfy-dir",
        default=os.environ.get("COMFYUI_PATH") or str(ROOT / ".gpu" / "comfyui"),
        help="ComfyUI tree (default: $COMFYUI_PATH, else .gpu/comfyui)",
    )
    ap.add_argument("--work", default="/tmp/wan22_node", help="ComfyUI base dir (models, user, output)")
    ap.add_argument("--cpu", action="store_true", help="ComfyUI --cpu (DynamicVRAM off, no ballast, fp32)")
    ap.add_argument(
        "--tiny", action="store_true", help="the suite's tiny Wan 2.2 A14B fixture (CPU smoke test)"
    )
    ap.add_argument("--cap", type=float, default=12.0, help="imitate a card of this many GiB (0: no ballast)")
    ap.add_argument("--layers", type=int, default=10, help="blocks of each denoiser (A14B has 40)")
    ap.add_argument("--width", type=int, default=None, help="default 832 (tiny: 64)")
    ap.add_argument("--height", type=int, default=None, help="default 480 (tiny: 64)")
    ap.add_argument("--frames", type=int, default=5, help="video frames (4n+1)")
    ap.add_argument(
        "--steps",
        type=int,
        default=10,
        help="denoise steps; both denoisers must run (at shift 12 and boundary 0.875: 7 + 3)",
    )
    ap.add_argument("--preload", default="auto", help="Offload settings 'preload'")
    ap.add_argument("--comfy-args", default="", help="extra ComfyUI command-line flags")
    ap.add_argument("--cache", choices=["ram", "classic", "lru"], default="ram", help="executor cache")
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--json", default=None, help="append JSON lines here")
    ap.add_argument("--anchor-dir", default=None, help="folder of native_bench.py (ComfyUI's GPU start-up)")
    ap.add_argument("--rebuild", action="store_true", help="write the model again even when stamped")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resident-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.width = a.width or (64 if a.tiny else 832)
    a.height = a.height or (64 if a.tiny else 480)
    return a


def paths(a: argparse.Namespace) -> SimpleNamespace:
    base = Path(a.work).resolve()
    tag = "tiny" if a.tiny else f"14b_L{a.layers}"
    return SimpleNamespace(
        base=base,
        pipe=base / "models" / "diffusers" / PIPE_NAME,
        stamp=base / "models" / f"wan22_{tag}.json",
        measures=base / "wan22_measures.json",
    )


def device_of(a: argparse.Namespace) -> str:
    import torch

    return "cuda" if (not a.cpu and torch.cuda.is_available()) else "cpu"


# -- the subprocesses: the model written, each denoiser timed resident -----------------------------
def ensure_model(a: argparse.Namespace) -> dict[str, Any]:
    p, key = paths(a), [a.layers, a.tiny, STAMP_VERSION]
    if not a.rebuild and p.stamp.is_file() and (p.pipe / "model_index.json").is_file():
        stamp = json.loads(p.stamp.read_text())
        if stamp.get("args") == key:
            return dict(stamp["build"], reused=True)
    build = rerun_json("--build-only", "BUILD")
    p.stamp.write_text(json.dumps({"args": key, "build": build}))
    return build


def build_only(a: argparse.Namespace) -> int:
    from benchkit.wan22 import write_pipeline

    p = paths(a)
    p.pipe.parent.mkdir(parents=True, exist_ok=True)
    print("BUILD " + json.dumps(write_pipeline(p.pipe, a.layers, a.tiny, device_of(a))), flush=True)
    return 0


def resident_only(a: argparse.Namespace) -> int:
    from benchkit.wan22 import resident_steps

    shape = latent_shape(a.width, a.height, a.frames)
    print("RESIDENT " + json.dumps(resident_steps(paths(a).pipe, shape, device_of(a))), flush=True)
    return 0


# -- ComfyUI ---------------------------------------------------------------------------------------
def prompt(a: argparse.Namespace, p: SimpleNamespace, seed: int) -> dict[str, Any]:
    settings = {
        "mode": "auto",
        "use_stream": True,
        "record_stream": False,
        "pin_memory": True,
        "pin_reserve_gb": 4.0,
        "on_demand_threshold_gb": 1.0,
        "resident_floor_mb": 64.0,
        "always": "",
        "never": "",
        "preload": a.preload,
        "prefetch_window": 1,
        "device": "",
        "measures_path": str(p.measures),
    }
    if a.tiny:  # tiny parts get the roles full-size ones would (tools/offload_examples.TINY_OVERRIDES)
        settings.update(resident_floor_mb=0.0, on_demand_threshold_gb=0.0)
    return {
        "s": {"class_type": "DiffusersOffloadSettings", "inputs": settings},
        "l": {
            "class_type": "DiffusersOffloadLoadPipeline",
            "inputs": {"model": PIPE_NAME, "dtype": "fp32" if a.cpu else "bf16", "offload": ["s", 0]},
        },
        "g": {
            "class_type": "DiffusersOffloadGenerateVideo",
            "inputs": {
                "pipe": ["l", 0],
                "prompt": "a red fox running through snow",
                "negative_prompt": "",
                "seed": seed,
                "steps": a.steps,
                "guidance": 1.0,
                "width": a.width,
                "height": a.height,
                "frames": a.frames,
                "fps": 0.0,
            },
        },
        "cf": {"class_type": "Wan22Capture", "inputs": {"value": ["g", 1], "key": "frames"}},
    }


def main() -> int:
    a = parse_args()
    offline()
    if a.build_only:
        return build_only(a)
    if a.resident_only:
        return resident_only(a)
    p, comfy_dir = paths(a), comfy_tree(a.comfy_dir)
    t_start = time.perf_counter()

    def stamp(what: str) -> None:
        print(f"== [{time.perf_counter() - t_start:6.1f}s] {what}", flush=True)

    build = ensure_model(a)
    stamp(f"model ready: {json.dumps(build)}")
    resident = rerun_json("--resident-only", "RESIDENT")
    stamp("resident steps: " + ", ".join(f"{n} {r['median_s']:.4f} s" for n, r in resident.items()))
    p.measures.unlink(missing_ok=True)  # every invocation learns its measures afresh
    av_stubbed = bc.stub_av_if_missing()
    t0 = time.perf_counter()
    anchor = None if a.cpu else bc.anchor_dir([Path(a.anchor_dir)] if a.anchor_dir else list(ANCHOR_DIRS))
    host = bc.start_host(comfy_dir, p.base, a.comfy_args.split(), a.cache, anchor)
    stamp(f"ComfyUI {host.version} up in {time.perf_counter() - t0:.1f}s")

    import comfy.model_management as mm
    import torch
    from benchkit.comfy_run import aimdo_enabled
    from benchkit.measure import Ballast, MemoryPoller, h2d_bandwidth
    from benchkit.wan22 import DenoiserClock, decode_ooms, resolver

    cuda = (not a.cpu) and torch.cuda.is_available()
    require_nodes(host, "DiffusersOffloadGenerateVideo")
    capture = bc.capture_class()
    host.nodes.NODE_CLASS_MAPPINGS["Wan22Capture"] = capture
    host.comfy_utils.PROGRESS_THROTTLE_MIN_INTERVAL = 0.0
    engine = host.pack_submodule("nodes.host").ENGINE
    clock = DenoiserClock(torch, cuda, resolver(engine, mm))
    decodes = decode_ooms(engine, mm)
    clock.install()
    h2d = h2d_bandwidth() if cuda else None
    env = {
        "section": "env",
        "comfyui": host.version,
        "torch": torch.__version__,
        "cpu": a.cpu,
        "tiny": a.tiny,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "aimdo_enabled": aimdo_enabled(),
        "allocator": torch.cuda.get_allocator_backend() if cuda else None,
        "vram_state": str(mm.vram_state),
        "av_stubbed": av_stubbed,
        "startup_notes": host.startup_notes,
        "h2d_gbs": h2d / 1e9 if h2d else None,
        "build": build,
        "resident": resident,
        "latent": latent_shape(a.width, a.height, a.frames),
        "args": vars(a),
    }
    emit(a, env, echo=True)

    poller = MemoryPoller(a.poll_ms / 1000.0) if cuda else None
    ballast = Ballast(a.cap, card=True) if cuda and a.cap > 0 else None
    if ballast is not None:
        stamp(f"ballast holds {ballast.hold / GiB:.2f} GiB: the card has {ballast.card / GiB:.2f} GiB")
    if poller is not None:
        poller.start()
    runs = []
    try:
        for run in (1, 2):
            clock.run = run
            stamp(f"run {run}")
            runs.append(run_once(a, p, host, torch, capture, poller, ballast, run, decodes))
            emit(a, runs[-1])
    finally:
        if poller is not None:
            poller.stop()
        if ballast is not None:
            ballast.close()
    for f in clock.forwards:
        emit(a, f)
    return report(a, clock, runs, resident, h2d, ballast, poller, time.perf_counter() - t_start)


def run_once(a, p, host, torch, capture, poller, ballast, run: int, decodes) -> dict[str, Any]:
    """One queue of the prompt (seed = run: the generate node runs again, the loader stays cached);
    the allocator's OOMs and retries over the whole run (text encoder and VAE included), and the
    OOMs the VAE's calls met (``decodes()``: the engine's count, run again after a give-back)."""
    from benchkit.measure import alloc_counts

    if poller is not None:
        poller.reset()
    capture.seen.clear()
    counts0, decode0 = alloc_counts(), decodes()
    t0 = time.perf_counter()
    err = queue(host, prompt(a, p, run), ["cf"], f"run {run}")
    frames = next((v for k, v in reversed(capture.seen) if k == "frames"), None)
    row = {
        "section": "run",
        "run": run,
        "error": err,
        "wall_s": round(time.perf_counter() - t0, 3),
        "output_finite": None if frames is None else bool(torch.isfinite(frames).all()),
        "alloc_ooms": alloc_counts()[0] - counts0[0],
        "alloc_retries": alloc_counts()[1] - counts0[1],
        "decode_ooms": decodes() - decode0,
    }
    if poller is not None:
        poller.sample()
        used = ballast.used if ballast else 0
        row.update(
            peak_used_less_ballast_gib=gib(poller.peak - used),
            min_free_gib=gib(poller.min_free),
            card_gib=gib(ballast.card) if ballast else None,
        )
        try:  # not every allocator backend keeps peaks
            row["torch_max_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
        except Exception as exc:
            print("max_memory_reserved:", exc, flush=True)
    print(f"== run {run}: wall {row['wall_s']:.2f} s, error={err}", flush=True)
    return row


def report(a, clock, runs, resident, h2d, ballast, poller, total_s: float) -> int:
    from benchkit.wan22 import TOLERANCE, denoiser_row, print_table, verdict_lines

    rows = [denoiser_row(clock, 2, n, resident.get(n, {}).get("median_s"), h2d) for n in DENOISERS]
    for r in rows:
        emit(a, r)
    engine_ooms = sum(
        max((f["engine_ooms_total"] or 0 for f in clock.forwards if f["denoiser"] == n), default=0)
        for n in DENOISERS
    ) + sum(r["decode_ooms"] for r in runs)  # cumulative since the placement in run 1; the VAE's per run
    alloc_ooms = sum(r["alloc_ooms"] for r in runs)
    ooms = alloc_ooms + engine_ooms
    flow_only = a.cpu or h2d is None  # the CPU checks the flow: its step ratios are not the GPU's
    errors = [f"run {r['run']}: {r['error']}" for r in runs if r["error"]]
    under = None
    if poller is not None and ballast is not None:
        under = poller.run_peak - ballast.used <= ballast.card
    s = {
        "section": "summary",
        "total_s": round(total_s, 1),
        "errors": errors,
        "ooms": ooms,
        "alloc_ooms": alloc_ooms,
        "engine_ooms": engine_ooms,
        "alloc_retries": sum(r["alloc_retries"] for r in runs),
        "tolerance": TOLERANCE,
        "denoisers_ok": {r["denoiser"]: r["ok"] for r in rows},
        "under_cap": under,
        "outputs_finite": all(r["output_finite"] is not False for r in runs),
        "peak_used_less_ballast_gib": gib(poller.run_peak - (ballast.used if ballast else 0))
        if poller
        else None,
    }
    s["steps_checked"] = not flow_only
    s["ok"] = (
        not errors
        and ooms == 0
        and under is not False
        and all(r["forwards"] for r in rows)
        and (flow_only or all(r["ok"] for r in rows))
    )
    emit(a, s)
    print(
        f"\n================ wan22_node report (run 2 timed) ================\n{a.layers if not a.tiny else 'tiny'} "
        f"blocks per denoiser, {a.width}x{a.height}x{a.frames}, {a.steps} steps, cap "
        f"{f'{ballast.card / GiB:.2f} GiB' if ballast else 'none'}"
    )
    for r in runs:
        error = f"  ERROR {r['error']}" if r["error"] else ""
        print(
            f"run {r['run']}: wall {r['wall_s']:.2f} s, peak less ballast {r.get('peak_used_less_ballast_gib', '-')} "
            f"GiB, OOMs {r['alloc_ooms']} (decode met {r['decode_ooms']}), retries {r['alloc_retries']}, output finite {r['output_finite']}{error}"
        )
    for n in DENOISERS:
        first = [round(f["seconds"], 4) for f in clock.of(1, n)]
        print(f"run 1 {n}: {len(first)} forwards {first}")
    print_table(rows, h2d)
    for line in verdict_lines(rows, alloc_ooms, engine_ooms, flow_only):
        print(line)
    print(
        f"SUMMARY ok={s['ok']} ooms={ooms} denoisers_ok={s['denoisers_ok']} under_cap={under} "
        f"peak={s['peak_used_less_ballast_gib']} errors={errors or 'none'} total={s['total_s']} s",
        flush=True,
    )
    return 0 if s["ok"] else 1


def emit(a: argparse.Namespace, row: dict[str, Any], echo: bool = False) -> None:
    """One JSON line to --json (echoed to stdout only without --json, or when asked)."""
    line = json.dumps(row, default=str)
    if echo or not a.json:
        print("JSON " + line, flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())

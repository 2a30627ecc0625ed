"""An fp8-scaled Wan single file through the nodes in a real ComfyUI, ours beside native (issue 23).

One ComfyUI process (as ``main.py`` starts it on a GPU: DynamicVRAM on; the suite's host,
``tests/comfyhost/harness.py``) runs one workflow holding two chains on the same file, branch by
branch ("queue selected output"), each forward timed:

  ours     Load diffusion model file (diffusers) -> Generate video   (bf16 compute, fp8 storage kept)
  native   UNETLoader (--native-weight-dtype) -> forward timer -> KSampler (cfg 1, euler/simple)

The file: Wan 2.1 T2V 14B geometry with ``--layers`` blocks, random weights in Comfy-Org's
fp8_scaled layout (fp8 Linear weights, per-tensor ``scale_weight``, ``scaled_fp8`` marker), written
tensor by tensor by a build process into models/diffusion_models, beside a configs-only diffusers
folder, a one-layer UMT5 text-encoder file and a small Wan VAE file (benchkit/single_file.py,
benchkit/denoiser_files.py).
Workloads: small (512x512, 1 frame: latent 1x16x1x64x64) and video (832x480, 81 frames: 1x16x21x60x104).
The marker is empty, so a 2026 ComfyUI on a GPU with fp8 compute (the H200) may run these layers as
fp8 matmuls, where ours dequantises to bf16 (the native rows record ``native_fp8_matmul``) unless
``--fp8-matmul`` turns our loader's fp8 matmuls on; ``--full-precision-mm`` writes a 2-element
marker, with which ComfyUI dequantises too.

Order: a ballast makes the card ``--cap`` GiB, then per workload the phases of ``--sequence``; then,
the ballast gone, ours on the whole card (the fp8-resident step: the plan keeps every block) and
what the card still holds once everything is unloaded (``after_release``); before each
capped phase every model is unloaded (ComfyUI's ``unload_all_models``: each side gets the whole card;
``--coexist`` leaves them to take memory from each other), but not before an ``again`` phase (ours
with the model still placed by the phase before: a user's next prompt). Rows (JSON lines to --json / --out):
per-forward median after the first, ours / native, our bound = max(fp8-resident step, streamed
storage bytes / pinned H2D measured in this process), OOMs and retries, host RSS against storage.

GPU (carry .gpu and .whl; the pip/tar install lines of bench/fp8_native.sh first):
    python3 bench/single_file_node.py --comfy-dir .gpu/comfyui --cap 12 --layers 40 --out $OUT
CPU smoke (the harness's own --cpu start-up, tiny geometry, no ballast; any ComfyUI tree):
    .venv/bin/python bench/single_file_node.py --cpu --tiny --comfy-dir <ComfyUI tree>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Nothing here may import torch before ComfyUI's start-up has run (cuda_malloc picks the allocator).
import benchkit.comfy as bc
import comfy_coexist as coexist
from benchkit import ROOT, GiB, gib, open_output, output_args
from benchkit.comfy_run import comfy_tree, offline, queue, require_nodes, rerun_json
from benchkit.single_file import (
    gbs,
    host_rss,
    native_facts,
    ours_facts,
    print_table,
    steady,
    summarize,
    unload_all,
)

ANCHOR_DIRS = (ROOT / ".gpu" / "native_anchor", ROOT.parent / "shared" / "reference" / "native_anchor")
WORKLOADS = {"small": (512, 512, 1), "video": (832, 480, 81)}  # width, height, frames
TINY_WORKLOADS = {"small": (64, 64, 1), "video": (64, 64, 5)}
STAMP_VERSION = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    comfy = os.environ.get("COMFYUI_PATH") or str(ROOT / ".gpu" / "comfyui")
    ap.add_argument("--comfy-dir", default=comfy, help="ComfyUI tree ($COMFYUI_PATH, else .gpu/comfyui)")
    ap.add_argument("--work", default="/tmp/single_file_node", help="ComfyUI base dir (models, user, output)")
    ap.add_argument("--cpu", action="store_true", help="ComfyUI --cpu (DynamicVRAM off, no ballast)")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry (width 128, 2 blocks; CPU smoke test)")
    ap.add_argument("--cap", type=float, default=12.0, help="imitate a card of this many GiB (0: no ballast)")
    ap.add_argument("--layers", type=int, default=40, help="blocks (14B: 40; 20 for a quicker run)")
    ap.add_argument("--workloads", default="small,video", help="comma list of: " + ", ".join(WORKLOADS))
    ap.add_argument("--steps", type=int, default=4, help="denoise steps (= forwards, cfg 1) of each phase")
    ap.add_argument("--sequence", default="ours,native", help="capped phases per workload, in order")
    dtypes = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast"]
    ap.add_argument(
        "--native-weight-dtype", choices=dtypes, default="default", help="UNETLoader's weight_dtype"
    )
    ap.add_argument("--full-precision-mm", action="store_true", help="a 2-element scaled_fp8 marker (above)")
    ap.add_argument("--nvfp4", action="store_true", help="the denoiser as a ComfyUI NVFP4 file (benchkit/denoiser_files.py); "
                    "native loads it as stored (weight_dtype default: ComfyUI decodes NVFP4 below Blackwell)")
    ap.add_argument("--fp8-matmul", action="store_true", help="our loader's fp8_matmul on (ComfyUI's _fast)")
    ap.add_argument("--no-resident", action="store_true", help="skip the uncapped fp8-resident phases")
    ap.add_argument("--coexist", action="store_true", help="do not unload the other model before a phase")
    ap.add_argument("--preload", default="auto", help="Offload settings 'preload' of our loader")
    ap.add_argument("--comfy-args", default="", help="extra ComfyUI command-line flags")
    ap.add_argument("--cache", choices=["ram", "classic", "lru"], default="classic", help="executor cache")
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--anchor-dir", default=None, help="folder of make_wan_sd.py and native_bench.py")
    ap.add_argument("--rebuild", action="store_true", help="write the files again even when stamped")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    output_args(ap)
    a = ap.parse_args(argv)
    if a.tiny:
        a.layers = min(a.layers, 2)
    a.workload_list = [w.strip() for w in a.workloads.split(",") if w.strip()]
    if unknown := [w for w in a.workload_list if w not in WORKLOADS]:
        ap.error(f"unknown workloads {unknown}")
    return a


def anchor_dir(a: argparse.Namespace) -> Path:
    return bc.anchor_dir([Path(a.anchor_dir)] if a.anchor_dir else list(ANCHOR_DIRS))


def paths(a: argparse.Namespace) -> SimpleNamespace:
    """Every file of a geometry under its own names (a config folder says its block count)."""
    base, size = Path(a.work).resolve(), "tiny" if a.tiny else "14b"
    tag = f"{size}_L{a.layers}{'_fpmm' if a.full_precision_mm else ''}{'_nvfp4' if a.nvfp4 else ''}"
    names = SimpleNamespace(
        config=f"wan21_t2v_{tag}_configs",
        denoiser=f"wan21_t2v_{tag}_random_{'nvfp4' if a.nvfp4 else 'fp8_scaled'}.safetensors",
        text_encoder=f"umt5_1layer_{size}_random.safetensors",
        vae=f"wan21_vae_{size}_random.safetensors",
    )
    m = base / "models"
    return SimpleNamespace(
        base=base,
        names=names,
        tag=tag,
        config_dir=m / "diffusers" / names.config,
        denoiser=m / "diffusion_models" / names.denoiser,
        stamp=m / f"single_file_{tag}.json",
        text_encoder=m / "text_encoders" / names.text_encoder,
        vae=m / "vae" / names.vae,
    )


def geometry(a: argparse.Namespace) -> dict[str, int]:
    return dict(bc.NATIVE_TINY if a.tiny else bc.NATIVE_14B, layers=a.layers)


# -- the files, written by a process of its own (its allocations and RNG never touch this one) ----
def ensure_models(a: argparse.Namespace) -> dict[str, Any]:
    p = paths(a)
    key = [a.layers, a.tiny, a.full_precision_mm, a.nvfp4, STAMP_VERSION]
    ready = all(
        f.is_file() for f in (p.stamp, p.denoiser, p.text_encoder, p.vae, p.config_dir / "model_index.json")
    )
    stamp = json.loads(p.stamp.read_text()) if ready and not a.rebuild else {}
    if stamp.get("args") == key:
        return {"reused": True, **stamp.get("build", {})}
    t0 = time.perf_counter()
    return dict(rerun_json("--build-only", "BUILD"), build_process_s=round(time.perf_counter() - t0, 2))


def build_only(a: argparse.Namespace) -> int:
    import torch
    from benchkit.single_file import build

    p = paths(a)
    device = "cuda" if (not a.cpu and torch.cuda.is_available()) else "cpu"
    info = build(anchor_dir(a), p, geometry(a), device, a.tiny, 2 if a.full_precision_mm else 0, a.nvfp4)
    key = [a.layers, a.tiny, a.full_precision_mm, a.nvfp4, STAMP_VERSION]
    p.stamp.write_text(json.dumps({"args": key, "geometry": geometry(a), "build": info}))
    print("BUILD " + json.dumps(info), flush=True)
    return 0


# -- the workflow ---------------------------------------------------------------------------------
def workflow(a: argparse.Namespace, p: SimpleNamespace, workload: str, seed: int) -> dict[str, Any]:
    """comfy_coexist's two chains (its Offload settings, Generate video, native sampler, timer and
    captures) with our single-file loader in place of its folder loader, and both on one file.
    The loaders' inputs never change: they stay cached from phase to phase."""
    width, height, frames = (TINY_WORKLOADS if a.tiny else WORKLOADS)[workload]
    w = SimpleNamespace(**vars(a), width=width, height=height, frames=frames)
    ours = coexist.ours_prompt(w, seed)
    names = {"denoiser": p.names.denoiser, "text_encoder": p.names.text_encoder, "vae": p.names.vae}
    inputs = {"config": p.names.config, **names, "dtype": "auto" if a.cpu else "bf16", "offload": ["s", 0],
              "fp8_matmul": a.fp8_matmul}
    ours["l"] = {"class_type": "DiffusersOffloadLoadDiffusionModelFile", "inputs": inputs}
    native = coexist.native_prompt(w, SimpleNamespace(native_name=p.names.denoiser), seed)
    native["n1"]["inputs"]["weight_dtype"] = a.native_weight_dtype
    return {**ours, **native}


# -- a run ------------------------------------------------------------------------------------------
def main() -> int:
    a = parse_args()
    offline()
    if a.build_only:
        return build_only(a)
    p, comfy_dir = paths(a), comfy_tree(a.comfy_dir)
    rows = open_output(a, "single_file_node", lines=True)
    rows.echo = False
    t_start = time.perf_counter()
    build = ensure_models(a)
    print(f"== files ready: {json.dumps(build)}", flush=True)
    av_stubbed = bc.stub_av_if_missing()
    t0 = time.perf_counter()
    host = bc.start_host(comfy_dir, p.base, a.comfy_args.split(), a.cache, None if a.cpu else anchor_dir(a))
    boot_s = round(time.perf_counter() - t0, 2)

    import comfy.model_management as mm
    import torch

    cuda = (not a.cpu) and torch.cuda.is_available()
    rec = bc.Recorder(torch, cuda)
    require_nodes(host, "DiffusersOffloadLoadDiffusionModelFile", "DiffusersOffloadGenerateVideo")
    host.nodes.NODE_CLASS_MAPPINGS.update(bc.helper_nodes(rec))
    host.comfy_utils.PROGRESS_THROTTLE_MIN_INTERVAL = 0.0
    rec.install(mm)
    rec.time_transformer()
    from benchkit.measure import Ballast, MemoryPoller, alloc_counts, h2d_bandwidth

    h2d = h2d_bandwidth() if cuda else None
    gpu = torch.cuda.get_device_name(0) if cuda else None
    env = {"comfyui": host.version, "torch": torch.__version__, "gpu": gpu, "vram_state": str(mm.vram_state)}
    args = {k: v for k, v in vars(a).items() if k != "workload_list"}
    rows(
        section="env",
        **env,
        startup=host.startup_notes,
        av_stubbed=av_stubbed,
        boot_s=boot_s,
        build=build,
        storage_bytes=p.denoiser.stat().st_size,
        h2d_gbs=h2d and round(h2d / 1e9, 2),
        rss=host_rss(),
        args=args,
    )
    print(f"== ComfyUI {host.version} up in {boot_s:.1f} s; pinned H2D {gbs(h2d)}", flush=True)
    ctx = SimpleNamespace(a=a, p=p, host=host, mm=mm, rec=rec, alloc_counts=alloc_counts, phases=[])
    ctx.poller, ctx.ballast_used, ctx.seed = None, 0, 0
    ballast = Ballast(a.cap, card=True) if cuda and a.cap > 0 else None
    if ballast is not None:
        ctx.ballast_used = ballast.used
        rows(section="ballast", cap_gib=a.cap, hold_gib=gib(ballast.hold), card_gib=gib(ballast.card))
        print(f"== ballast: the card holds {ballast.card / GiB:.2f} GiB", flush=True)
    if cuda:
        ctx.poller = MemoryPoller(a.poll_ms / 1000.0)
        ctx.poller.start()
    try:
        for w in a.workload_list:
            for phase in [s.strip() for s in a.sequence.split(",") if s.strip()]:
                if phase not in ("ours", "again", "native"):
                    raise SystemExit(f"unknown phase {phase!r} in --sequence (ours, again, native)")
                run_phase(ctx, phase, w, rows)
    finally:
        if ctx.poller is not None:
            ctx.poller.stop()
        if ballast is not None:
            ballast.close()
    if not a.no_resident:  # after the capped phases: what a release leaves on the card is read, not capped
        for w in a.workload_list:
            run_phase(ctx, "resident", w, rows)
        unload_all(mm)
        rows(section="after_release", **device_left(rec.torch))
    results = summarize(ctx, h2d, rows)
    print_table(ctx, results, h2d, time.perf_counter() - t_start)
    rows.save()
    return 0 if not any(r["error"] for r in ctx.phases) else 1


def device_left(torch) -> dict[str, float]:
    """What this process still holds on the card once every model is unloaded (GiB): live tensors,
    the allocator's cache, and the card's used memory (the CUDA context and anything outside torch)."""
    import gc

    if not torch.cuda.is_available():
        return {}
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    left = dict(allocated=torch.cuda.memory_allocated() / GiB, reserved=torch.cuda.memory_reserved() / GiB,
                card_used=(total - free) / GiB)
    print(f"== after release: {left}", flush=True)
    return left


def run_phase(c: SimpleNamespace, phase: str, workload: str, rows) -> dict[str, Any]:
    """One branch of the workflow; ``resident`` is ours after the ballast (the whole card)."""
    rec, torch, ours = c.rec, c.rec.torch, phase != "native"
    c.seed += 1
    rec.begin_phase()
    if phase in ("ours", "native") and not c.a.coexist:
        unload_all(c.mm)  # each side gets the whole card
    counts0 = c.alloc_counts()
    if c.poller is not None:
        c.poller.reset()
    t0 = time.perf_counter()
    print(f"== phase {phase} {workload} (seed {c.seed})", flush=True)
    err = queue(c.host, workflow(c.a, c.p, workload, c.seed), ["ch", "cf"] if ours else ["cm", "cl"], phase)
    wall = time.perf_counter() - t0
    for key, attr in (("ours_handle", "ours"), ("native_model", "native")):
        got = rec.captured(key)
        if got is not None:
            setattr(rec, attr, getattr(got, "patcher", got) if attr == "ours" else got)
    out = rec.captured("ours_frames" if ours else "native_latent")
    out = out["samples"] if isinstance(out, dict) else out
    times = [s for who, s in rec.forwards if who == ("ours" if ours else "native")]
    counts = [n - m for n, m in zip(c.alloc_counts(), counts0, strict=True)]
    row = {
        "section": "phase",
        "phase": phase,
        "workload": workload,
        "seed": c.seed,
        "error": err,
        "wall_s": round(wall, 3),
        "forward_s": [round(x, 4) for x in times],
        "first_forward_s": round(times[0], 4) if times else None,
        "median_rest_s": round(statistics.median(times[1:]), 4) if len(times) > 1 else None,
        **steady(times),
        "output_finite": None if out is None else bool(torch.isfinite(out).all()),
        "torch_ooms": counts[0],
        "alloc_retries": counts[1],
        **host_rss(),
        **facts(rec, ours),
        "after": rec.snapshot(c.mm, c.ballast_used),
        "events": list(rec.events),
        "log": rec.log[-40:],
    }
    if c.poller is not None:
        c.poller.sample()
        row.update(
            peak_used_less_ballast_gib=gib(c.poller.peak - c.ballast_used),
            torch_max_alloc_gib=gib(torch.cuda.max_memory_allocated()),
        )
    rec.capture.seen.clear()
    c.phases.append(row)
    rows(**row)
    print(f"   wall {wall:.2f} s, forwards {row['forward_s']}, error={err}", flush=True)
    return row


def facts(rec, ours: bool) -> dict[str, Any]:
    patcher = rec.ours if ours else rec.native
    return {} if patcher is None else (ours_facts if ours else native_facts)(patcher)


if __name__ == "__main__":
    sys.exit(main())

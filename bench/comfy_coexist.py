"""Our nodes beside a native ComfyUI model in one ComfyUI process, under a VRAM cap (issue 3).

One process boots a real ComfyUI (the 2026 tree) as its ``main.py`` does, so DynamicVRAM is on when
a GPU is present: the test suite's host (``tests/comfyhost/harness.py``) with main.py's start-up
instead of its forced ``--cpu``. A ballast process makes the card ``--cap`` GiB in all. One
workflow holds both chains and is queued branch by branch (both loaders stay cached), through
ComfyUI's executor as ``POST /prompt`` runs it, in the phases of ``--sequence``:

  ours     Load diffusers pipeline (preload auto) -> Generate video; later: takes VRAM back from native
  native   UNETLoader -> forward timer -> KSampler (cfg 1, euler/simple); later: takes VRAM back from us

Both: latent 1x16x2x60x104 (480x832, 5 frames), text states 1x512x4096, bf16, the Wan 14B transformer
geometry with ``--layers`` blocks (ours a diffusers folder, native ComfyUI's layout by the native
anchor's ``make_wan_sd.py``), random weights written by a build process and reused while stamped.
Recorded per phase (benchkit.comfy.Recorder): forwards, ComfyUI's memory calls (who gave what back),
what each model holds, device memory polled less the ballast. JSON lines go to ``--json``.

GPU (driver, with the wheels and tree it carries: bench/comfy_coexist.sh):
    python3 bench/comfy_coexist.py --comfy-dir .gpu/comfyui --cap 24 --layers 20 --json $OUT/coexist.jsonl
CPU smoke (the harness's own --cpu start-up, tiny models, no ballast; any ComfyUI tree):
    .venv/bin/python bench/comfy_coexist.py --cpu --tiny --cache classic --comfy-dir <ComfyUI tree>
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
from benchkit import ROOT, GiB, gib, version_of
from benchkit.coexist_report import fmt, print_report, summarize
from benchkit.comfy_run import aimdo_enabled, comfy_tree, offline, queue, require_nodes, rerun_json

PIPE_NAME = "wan_coexist"
ANCHOR_DIRS = (ROOT / ".gpu" / "native_anchor", ROOT.parent / "shared" / "reference" / "native_anchor")


def anchor_dir(a: argparse.Namespace) -> Path:
    """The native anchor's folder (make_wan_sd.py, native_bench.py): --anchor-dir or the defaults."""
    return bc.anchor_dir([Path(a.anchor_dir)] if a.anchor_dir else list(ANCHOR_DIRS))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy-dir", default=os.environ.get("COMFYUI_PATH") or str(ROOT / ".gpu" / "comfyui"),
                    help="ComfyUI tree (default: $COMFYUI_PATH, else .gpu/comfyui)")
    ap.add_argument("--work", default="/tmp/comfy_coexist", help="ComfyUI base dir (models, user, output)")
    ap.add_argument("--cpu", action="store_true", help="ComfyUI --cpu (DynamicVRAM off, no ballast)")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry (CPU smoke test)")
    ap.add_argument("--cap", type=float, default=24.0, help="imitate a card of this many GiB (0: no ballast)")
    ap.add_argument("--layers", type=int, default=20, help="transformer blocks of both models (14B has 40)")
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--frames", type=int, default=5, help="video frames (4n+1); latent frames (n+1)")
    ap.add_argument("--steps", type=int, default=4, help="denoise steps of each run, ours and native")
    ap.add_argument("--sequence", default="ours,native,ours,native", help="phases in order")
    ap.add_argument("--native-dtype", choices=["default", "bf16"], default="bf16",
                    help="bf16 passes --bf16-unet (equal dtype with ours); default: ComfyUI's pick (fp16)")
    ap.add_argument("--preload", default="auto", help="Offload settings 'preload' of our loader")
    ap.add_argument("--comfy-args", default="", help="extra ComfyUI command-line flags")
    ap.add_argument("--cache", choices=["ram", "classic", "lru"], default="ram",
                    help="executor cache: ram = the 2026 server's default (keeps both models' loaders "
                         "cached across prompts); classic drops the other prompt's outputs")
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--json", default=None, help="append JSON lines here")
    ap.add_argument("--anchor-dir", default=None, help="folder of make_wan_sd.py and native_bench.py")
    ap.add_argument("--rebuild", action="store_true", help="write the models again even when stamped")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.tiny:
        a.layers = min(a.layers, 2)
    return a


# -- the models, written by a process of its own (its allocations and RNG never touch this one) --
def configs(a: argparse.Namespace) -> tuple[dict, dict]:
    from benchkit.models import wan_config  # torch: only in the build process and after start-up

    return wan_config(a.layers, a.tiny), dict(bc.NATIVE_TINY if a.tiny else bc.NATIVE_14B, layers=a.layers)


def paths(a: argparse.Namespace) -> SimpleNamespace:
    base = Path(a.work).resolve()
    tag = f"{'tiny' if a.tiny else '14b'}_L{a.layers}"
    native = f"wan21_t2v_{tag}_random_bf16.safetensors"
    return SimpleNamespace(base=base, pipe=base / "models" / "diffusers" / PIPE_NAME, native_name=native,
                           native=base / "models" / "diffusion_models" / native,
                           stamp=base / "models" / f"coexist_{tag}.json")


def ensure_models(a: argparse.Namespace) -> dict[str, Any]:
    p = paths(a)
    built = p.stamp.is_file() and p.native.is_file() and (p.pipe / "model_index.json").is_file()
    if not a.rebuild and built and json.loads(p.stamp.read_text()).get("args") == [a.layers, a.tiny, 1]:
        return {"reused": True}
    t0 = time.perf_counter()
    return dict(rerun_json("--build-only", "BUILD"), build_process_s=round(time.perf_counter() - t0, 2))


def build_only(a: argparse.Namespace) -> int:
    import torch

    p, (wan, native) = paths(a), configs(a)
    device = "cuda" if (not a.cpu and torch.cuda.is_available()) else "cpu"
    info = bc.write_models(p.pipe, p.native, wan, native, anchor_dir(a), device, a.tiny)
    p.stamp.write_text(json.dumps({"args": [a.layers, a.tiny, 1], "diffusers": wan, "native": native}))
    print("BUILD " + json.dumps(info), flush=True)
    return 0


# -- ComfyUI ---------------------------------------------------------------------------------------
def ours_prompt(a: argparse.Namespace, seed: int) -> dict[str, Any]:
    settings = {"mode": "auto", "use_stream": True, "record_stream": False, "pin_memory": True, "pin_reserve_gb": 4.0,
                "on_demand_threshold_gb": 1.0, "resident_floor_mb": 64.0, "always": "", "never": "",
                "preload": a.preload, "prefetch_window": 1, "device": "", "measures_path": ""}
    if a.tiny:  # tiny parts get the roles full-size ones would (tools/offload_examples.TINY_OVERRIDES)
        settings.update(resident_floor_mb=0.0, on_demand_threshold_gb=0.0)
    return {
        "s": {"class_type": "DiffusersOffloadSettings", "inputs": settings},
        "l": {"class_type": "DiffusersOffloadLoadPipeline",
              "inputs": {"model": PIPE_NAME, "dtype": "fp32" if a.cpu else "bf16", "offload": ["s", 0]}},
        "g": {"class_type": "DiffusersOffloadGenerateVideo",
              "inputs": {"pipe": ["l", 0], "prompt": "a red fox running through snow", "negative_prompt": "",
                         "seed": seed, "steps": a.steps, "guidance": 1.0, "width": a.width, "height": a.height,
                         "frames": a.frames, "fps": 0.0}},
        "ch": {"class_type": "CoexistCapture", "inputs": {"value": ["l", 0], "key": "ours_handle"}},
        "cf": {"class_type": "CoexistCapture", "inputs": {"value": ["g", 1], "key": "ours_frames"}},
    }


def native_prompt(a: argparse.Namespace, p: SimpleNamespace, seed: int) -> dict[str, Any]:
    return {
        "n1": {"class_type": "UNETLoader", "inputs": {"unet_name": p.native_name, "weight_dtype": "default"}},
        "n2": {"class_type": "CoexistTimer", "inputs": {"model": ["n1", 0], "tag": "native"}},
        "n3": {"class_type": "CoexistCond", "inputs": {"seed": seed, "text_len": 512}},
        "n4": {"class_type": "EmptyHunyuanLatentVideo",
               "inputs": {"width": a.width, "height": a.height, "length": a.frames, "batch_size": 1}},
        "n5": {"class_type": "KSampler",
               "inputs": {"model": ["n2", 0], "seed": seed, "steps": a.steps, "cfg": 1.0, "sampler_name": "euler",
                          "scheduler": "simple", "positive": ["n3", 0], "negative": ["n3", 0],
                          "latent_image": ["n4", 0], "denoise": 1.0}},
        "cm": {"class_type": "CoexistCapture", "inputs": {"value": ["n1", 0], "key": "native_model"}},
        "cl": {"class_type": "CoexistCapture", "inputs": {"value": ["n5", 0], "key": "native_latent"}},
    }


# -- a run ---------------------------------------------------------------------------------------
def main() -> int:
    a = parse_args()
    offline()
    if a.build_only:
        return build_only(a)
    p, comfy_dir = paths(a), comfy_tree(a.comfy_dir)
    t_start = time.perf_counter()

    def stamp(what: str) -> None:
        print(f"== [{time.perf_counter() - t_start:6.1f}s] {what}", flush=True)

    build = ensure_models(a)
    stamp(f"models ready: {json.dumps(build)}")
    av_stubbed = bc.stub_av_if_missing()
    t0 = time.perf_counter()
    flags = (["--bf16-unet"] if a.native_dtype == "bf16" else []) + a.comfy_args.split()
    host = bc.start_host(comfy_dir, p.base, flags, a.cache, None if a.cpu else anchor_dir(a))
    boot_s = round(time.perf_counter() - t0, 2)
    stamp(f"ComfyUI {host.version} up in {boot_s:.1f}s")

    import comfy.model_management as mm
    import comfy.model_patcher
    import torch
    from benchkit.measure import Ballast, MemoryPoller, alloc_counts

    cuda = (not a.cpu) and torch.cuda.is_available()
    rec = bc.Recorder(torch, cuda)
    require_nodes(host, "DiffusersOffloadGenerateVideo")
    host.nodes.NODE_CLASS_MAPPINGS.update(bc.helper_nodes(rec))
    host.comfy_utils.PROGRESS_THROTTLE_MIN_INTERVAL = 0.0
    rec.install(mm)
    rec.time_transformer()
    env = {
        "section": "env", "comfyui": host.version, "torch": torch.__version__, "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "cpu": a.cpu, "tiny": a.tiny,
        "aimdo_enabled": aimdo_enabled(),
        "core_model_patcher": getattr(comfy.model_patcher, "CoreModelPatcher", comfy.model_patcher.ModelPatcher).__name__,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "torch_allocator_backend": torch.cuda.get_allocator_backend() if cuda else None,
        "vram_state": str(mm.vram_state), "av_stubbed": av_stubbed, "boot_s": boot_s, "startup_notes": host.startup_notes,
        "pack_nodes": len(host.pack_status().node_ids), "build": build, "args": vars(a),
        **{k.replace("-", "_"): version_of(k) for k in ("diffusers", "transformers", "comfy-aimdo", "comfy-kitchen")},
    }
    emit(a, env)
    print(f"DynamicVRAM {'ON' if env['aimdo_enabled'] else 'off'}, CoreModelPatcher {env['core_model_patcher']}, "
          f"allocator {env['torch_allocator_backend']}, vram_state {env['vram_state']}, av stubbed {av_stubbed}", flush=True)

    poller = MemoryPoller(a.poll_ms / 1000.0) if cuda else None
    ballast = Ballast(a.cap, card=True) if cuda and a.cap > 0 else None
    if ballast is not None:
        emit(a, {"section": "ballast", "cap_gib": a.cap, "hold_gib": gib(ballast.hold), "ballast_used_gib": gib(ballast.used),
                 "card_gib": gib(ballast.card), "used_before_gib": gib(ballast.used_before),
                 "free_after_gib": gib(ballast.free_after), "total_gib": gib(poller.total)}, echo=True)
        stamp(f"ballast holds {ballast.hold / GiB:.2f} GiB: the card has {ballast.card / GiB:.2f} GiB")
    if poller is not None:
        poller.start()
    ctx = SimpleNamespace(a=a, p=p, host=host, mm=mm, rec=rec, poller=poller, alloc_counts=alloc_counts,
                          ballast_used=ballast.used if ballast else 0,
                          nvml_ballast=(ballast.nvml_used or 0) if ballast else 0)
    rows, seeds = [], {"ours": 0, "native": 0}
    try:
        for phase in [s.strip() for s in a.sequence.split(",") if s.strip()]:
            if phase not in seeds:
                raise SystemExit(f"unknown phase {phase!r} in --sequence (ours, native)")
            seeds[phase] += 1
            stamp(f"phase {phase} #{seeds[phase]}")
            rows.append(run_phase(ctx, phase, seeds))
            emit(a, rows[-1])
    finally:
        if poller is not None:
            poller.stop()
        if ballast is not None:
            ballast.close()
    summary = summarize(a, rows, poller, ballast, time.perf_counter() - t_start)
    emit(a, summary, echo=True)
    print_report(a, env, rows, summary, ballast)
    return 0 if summary["ok"] else 1


def run_phase(c: SimpleNamespace, phase: str, seeds: dict[str, int]) -> dict[str, Any]:
    """One branch of the one workflow holding both chains ("queue selected output"), as a user
    switching between branches of a workflow would run it."""
    rec, torch = c.rec, c.rec.torch
    prompt = {**ours_prompt(c.a, seeds["ours"]), **native_prompt(c.a, c.p, seeds["native"])}
    rec.begin_phase()
    before = rec.snapshot(c.mm, c.ballast_used)
    retries0 = sum(c.alloc_counts())
    if c.poller is not None:
        c.poller.reset()
    if rec.cuda:
        try:
            torch.cuda.reset_peak_memory_stats()
        except Exception as exc:  # not every allocator backend keeps peaks
            print("reset_peak_memory_stats:", exc, flush=True)
    t0 = time.perf_counter()
    err = queue(c.host, prompt, ["ch", "cf"] if phase == "ours" else ["cm", "cl"], phase)
    wall = time.perf_counter() - t0
    reloaded = False
    for key, attr in (("ours_handle", "ours"), ("native_model", "native")):
        got = rec.captured(key)
        got = getattr(got, "patcher", got) if key == "ours_handle" else got
        if got is not None:
            reloaded = reloaded or (getattr(rec, attr) is not None and got is not getattr(rec, attr))
            setattr(rec, attr, got)
    after = rec.snapshot(c.mm, c.ballast_used)
    out = rec.captured("ours_frames" if phase == "ours" else "native_latent")
    out = out["samples"] if isinstance(out, dict) else out
    times = [s for who, s in rec.forwards if who == phase]
    row = {"section": "phase", "phase": phase, "seed": seeds[phase], "error": err, "wall_s": round(wall, 3),
           "forwards": len(times), "forward_s": [round(x, 4) for x in times],
           "first_forward_s": round(times[0], 4) if times else None,
           "median_rest_s": round(statistics.median(times[1:]), 4) if len(times) > 1 else None,
           "output_finite": None if out is None else bool(torch.isfinite(out).all()), "model_reloaded": reloaded,
           "before": before, "after": after, "events": list(rec.events), "log": rec.log[-60:]}
    rec.capture.seen.clear()
    if c.poller is not None:
        c.poller.sample()
        peak, nvml = c.poller.peak, c.poller.peak_nvml
        row.update(peak_used_less_ballast_gib=gib(peak - c.ballast_used) if peak else None,
                   peak_nvml_less_ballast_gib=gib(nvml - c.nvml_ballast) if nvml else None,
                   min_free_gib=gib(c.poller.min_free), torch_max_alloc_gib=gib(torch.cuda.max_memory_allocated()),
                   torch_max_reserved_gib=gib(torch.cuda.max_memory_reserved()),
                   alloc_retries=sum(c.alloc_counts()) - retries0)
    print(f"== phase {phase} #{seeds[phase]}: wall {wall:.2f} s, forwards {row['forward_s']}, error={err}; "
          f"ours {fmt(after.get('ours_loaded_gib'))} GiB, native {fmt(after.get('native_loaded_gib'))} GiB loaded; "
          f"plan: {after.get('ours_plan', '')}", flush=True)
    for e in row["events"]:
        print(f"   {json.dumps(e)}")
    return row


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

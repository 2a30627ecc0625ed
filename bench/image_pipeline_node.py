"""An image model's whole pipeline from a ComfyUI user's three fp8 files, ours beside native, run after run.

``--family qwenimage`` (benchkit/qwen_image_files.py: the 20B transformer with fp8 blocks, the Qwen2.5-VL
7B text encoder fp8_scaled, the VAE) or ``flux2`` (benchkit/flux2_dev_files.py: FLUX.2 [dev]'s 32B
transformer with fp8 blocks, Mistral Small 3.1 pruned to 30 layers fp8_scaled, the VAE). One ComfyUI
process (as ``main.py`` starts it on a GPU: DynamicVRAM on) under a ``--cap`` GiB card (a ballast) runs
one workflow holding two chains on the same three files, branch by branch:

  ours     Offload settings -> Load diffusion model file (diffusers; config auto) -> Generate image
  native   UNETLoader -> timer -> KSampler (cfg 1, euler/simple) <- CLIPLoader -> CLIPTextEncode (FLUX.2:
           FluxGuidance 4) (negative: ConditioningZeroOut), the family's empty latent; VAELoader -> VAEDecode

Each side runs ``--prompts`` in turn (default: first, a new seed, a new prompt: what a user does next;
``again``: the first prompt's text with a new seed), the other side's models unloaded before its first.
Per run: wall, text encode, every transformer forward, VAE decode (each timed synchronised around the
component's call), ours' loading (files to a pipeline) and placing, OOMs, retries, peak card use less
the ballast, host RSS. cfg 1 on both: one forward a step. JSON lines to --json / --out.

GPU (carry .gpu and .whl; the pip/tar install lines of bench/fp8_native.sh first):
    python3 bench/image_pipeline_node.py --comfy-dir .gpu/comfyui --cap 12 --steps 8 --out $OUT
CPU smoke of ours (the suite's tiny model of the family; ComfyUI's own text encoders have their released
shapes, so no native):
    .venv/bin/python bench/image_pipeline_node.py --cpu --tiny --sides ours [--family flux2] --comfy-dir <ComfyUI tree>
"""

from __future__ import annotations

import argparse
import importlib
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
from benchkit import ROOT, gib, open_output, output_args
from benchkit.comfy_run import comfy_tree, offline, queue, require_nodes, rerun_json
from benchkit.qwen_image_files import FOLDERS
from benchkit.single_file import host_rss, unload_all

ANCHOR_DIRS = (ROOT / ".gpu" / "native_anchor", ROOT.parent / "shared" / "reference" / "native_anchor")
PROMPTS = {"first": ("a red fox in the snow, photograph", 1), "seed": ("a red fox in the snow, photograph", 2),
           "prompt": ("a lighthouse on a cliff at dusk, oil painting", 3),
           "again": ("a red fox in the snow, photograph", 4)}  # after a new prompt: the settled run
STAMP_VERSION = 1
FAMILIES = {  # files module, CLIPLoader type, empty latent node, guidance (ours; native's FluxGuidance where an
    # input of the model, not a second forward), classes timed
    "qwenimage": {"files": "qwen_image_files", "clip": "qwen_image", "latent": "EmptySD3LatentImage", "guidance": 1.0,
                  "model_guidance": False,
                  "classes": ("QwenImageTransformer2DModel", "Qwen2_5_VLForConditionalGeneration", "AutoencoderKLQwenImage")},
    "flux2": {"files": "flux2_dev_files", "clip": "flux2", "latent": "EmptyFlux2LatentImage", "guidance": 4.0,
              "model_guidance": True, "classes": ("Flux2Transformer2DModel", "MistralModel", "AutoencoderKLFlux2")},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy-dir", default=os.environ.get("COMFYUI_PATH") or str(ROOT / ".gpu" / "comfyui"))
    ap.add_argument("--work", default="/tmp/image_pipeline_node", help="ComfyUI base dir (models, user, output)")
    ap.add_argument("--cpu", action="store_true", help="ComfyUI --cpu (DynamicVRAM off, no ballast)")
    ap.add_argument("--family", choices=tuple(FAMILIES), default="qwenimage")
    ap.add_argument("--tiny", action="store_true", help="the suite's tiny model of the family (ours only)")
    ap.add_argument("--cap", type=float, default=12.0, help="imitate a card of this many GiB (0: no ballast)")
    ap.add_argument("--size", type=int, default=1024, help="image width and height")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sides", default="ours,native", help="in order")
    ap.add_argument("--prompts", default="first,seed,prompt", help="comma list of: " + ", ".join(PROMPTS))
    ap.add_argument("--fp8-matmul", action="store_true", help="our loader's fp8_matmul on")
    ap.add_argument("--no-graphs", action="store_true", help="our settings' cuda_graphs off")
    ap.add_argument("--comfy-args", default="", help="extra ComfyUI command-line flags")
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--pack-log", default="", help="write the pack's debug lines to this file")
    ap.add_argument("--rebuild", action="store_true", help="write the files again even when stamped")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    output_args(ap)
    a = ap.parse_args(argv)
    a.side_list = [s.strip() for s in a.sides.split(",") if s.strip()]
    a.prompt_list = [p.strip() for p in a.prompts.split(",") if p.strip()]
    if bad := [s for s in a.side_list if s not in ("ours", "native")] + [p for p in a.prompt_list if p not in PROMPTS]:
        ap.error(f"unknown sides or prompts {bad}")
    if a.tiny and "native" in a.side_list:
        ap.error("--tiny runs ours only (ComfyUI's text encoders have their released shapes)")
    a.files = importlib.import_module(f"benchkit.{FAMILIES[a.family]['files']}")
    return a


# -- the files, written by a process of its own (its allocations and RNG never touch this one) ----
def ensure_files(a: argparse.Namespace, models: Path) -> dict[str, Any]:
    stamp, key = models / f"{a.family}_files.json", [a.tiny, STAMP_VERSION]
    ready = stamp.is_file() and all((models / d / a.files.NAMES[n]).is_file() for n, d in FOLDERS.items())
    if not a.rebuild and ready and (stamped := json.loads(stamp.read_text())).get("args") == key:
        return {"reused": True, **stamped["sizes"]}
    t0 = time.perf_counter()
    sizes = rerun_json("--build-only", "BUILD")
    stamp.write_text(json.dumps({"args": key, "sizes": sizes}))
    return {**sizes, "build_s": round(time.perf_counter() - t0, 1)}


def build_only(a: argparse.Namespace, models: Path) -> int:
    import torch

    device = "cuda" if (not a.cpu and torch.cuda.is_available()) else "cpu"
    print("BUILD " + json.dumps(a.files.write(models, a.tiny, device)), flush=True)
    return 0


# -- the workflow ---------------------------------------------------------------------------------
def workflow(a: argparse.Namespace, text: str, seed: int) -> dict[str, Any]:
    """Both chains; the loaders' inputs never change, so they stay cached from run to run."""
    settings = {"mode": "auto", "use_stream": True, "record_stream": False, "pin_memory": True, "pin_reserve_gb": 4.0,
                "on_demand_threshold_gb": 0.0 if a.tiny else 1.0, "resident_floor_mb": 0.0 if a.tiny else 64.0,
                "always": "", "never": "", "preload": "auto", "prefetch_window": 1, "device": "", "measures_path": "",
                "cuda_graphs": not a.no_graphs}
    family, names = FAMILIES[a.family], a.files.NAMES
    load = {"config": a.files.TINY_CONFIG if a.tiny else "auto: the configs the pack carries",
            **{name: names[name] for name in FOLDERS}, "dtype": "auto" if a.cpu else "bf16", "offload": ["s", 0],
            "fp8_matmul": a.fp8_matmul}
    size = {"width": a.size, "height": a.size}
    guided = {"ng": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["n4", 0], "guidance": family["guidance"]}}
              } if family["model_guidance"] else {}
    positive = ["ng", 0] if guided else ["n4", 0]
    return {
        "s": {"class_type": "DiffusersOffloadSettings", "inputs": settings},
        "l": {"class_type": "DiffusersOffloadLoadDiffusionModelFile", "inputs": load},
        "g": {"class_type": "DiffusersOffloadGenerateImage",
              "inputs": {"pipe": ["l", 0], "prompt": text, "negative_prompt": "", "seed": seed, "steps": a.steps,
                         "guidance": family["guidance"], "batch_size": 1, **size}},
        "ch": {"class_type": "CoexistCapture", "inputs": {"value": ["l", 0], "key": "ours_handle"}},
        "ci": {"class_type": "CoexistCapture", "inputs": {"value": ["g", 0], "key": "ours_image"}},
        "n1": {"class_type": "UNETLoader", "inputs": {"unet_name": names["denoiser"], "weight_dtype": "default"}},
        "n2": {"class_type": "CoexistTimer", "inputs": {"model": ["n1", 0], "tag": "native"}},
        "n3": {"class_type": "CLIPLoader", "inputs": {"clip_name": names["text_encoder"], "type": family["clip"],
                                                      "device": "default"}},
        "n4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["n3", 0], "text": text}},
        "n5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["n4", 0]}},
        "n6": {"class_type": family["latent"], "inputs": {**size, "batch_size": 1}},
        "n7": {"class_type": "KSampler",
               "inputs": {"model": ["n2", 0], "seed": seed, "steps": a.steps, "cfg": 1.0, "sampler_name": "euler",
                          "scheduler": "simple", "positive": positive, "negative": ["n5", 0],
                          "latent_image": ["n6", 0], "denoise": 1.0}},
        "n8": {"class_type": "VAELoader", "inputs": {"vae_name": names["vae"]}},
        "n9": {"class_type": "VAEDecode", "inputs": {"samples": ["n7", 0], "vae": ["n8", 0]}},
        "cm": {"class_type": "CoexistCapture", "inputs": {"value": ["n1", 0], "key": "native_model"}},
        "cn": {"class_type": "CoexistCapture", "inputs": {"value": ["n9", 0], "key": "native_image"}},
        **guided,
    }


OUTPUTS = {"ours": ["ch", "ci"], "native": ["cm", "cn"]}


def install_timers(rec: bc.Recorder, nodes: Any, family: str) -> None:
    """Text encode, transformer forward and VAE decode of each side, timed around the component's
    call (ours: the engine's hooks inside; native: the node's call, its model loading inside)."""
    import diffusers
    import transformers

    denoiser, text_encoder, vae = FAMILIES[family]["classes"]
    rec.time_calls(getattr(diffusers, denoiser), "ours")
    rec.time_calls(getattr(transformers, text_encoder), "ours_text")
    rec.time_calls(getattr(diffusers, vae), "ours_decode", "decode")
    engine, single_file, pinning = (next(m for n, m in sys.modules.items() if n.endswith(tail))
                                    for tail in ("offload_core.engine", "nodes.single_file", "offload_core.pinning"))
    rec.time_calls(single_file, "ours_load", "load_pipeline_with_denoiser")  # the files to a pipeline
    rec.time_calls(engine.Engine, "ours_place", "place")  # placing it: pinning, the streamers' tables
    rec.time_calls(pinning.PinSet, "ours_pin", "pin_all")  # inside placing: copying into arenas, page-locking
    rec.time_calls(nodes.CLIPTextEncode, "native_text", "encode")
    rec.time_calls(nodes.VAEDecode, "native_decode", "decode")


# -- a run ------------------------------------------------------------------------------------------
def pack_debug_log(path: str) -> None:
    """Every line of the pack's logger at debug level into ``path`` (its decisions, graphs' first launches)."""
    import logging

    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(relativeCreated)9.0f %(name)s %(levelname)s: %(message)s"))
    pack = logging.getLogger("diffusers_offload")
    pack.setLevel(logging.DEBUG)
    pack.addHandler(handler)


def main() -> int:
    a = parse_args()
    offline()
    base = Path(a.work).resolve()
    if a.build_only:
        return build_only(a, base / "models")
    comfy_dir = comfy_tree(a.comfy_dir)
    rows = open_output(a, "image_pipeline_node", lines=True)
    rows.echo = False
    t_start = time.perf_counter()
    files = ensure_files(a, base / "models")
    print(f"== files ready: {json.dumps(files)}", flush=True)
    bc.stub_av_if_missing()
    t0 = time.perf_counter()
    host = bc.start_host(comfy_dir, base, a.comfy_args.split(), "classic", None if a.cpu else bc.anchor_dir(list(ANCHOR_DIRS)))
    boot_s = round(time.perf_counter() - t0, 2)

    import comfy.model_management as mm
    import torch

    cuda = (not a.cpu) and torch.cuda.is_available()
    rec = bc.Recorder(torch, cuda)
    if a.pack_log:
        pack_debug_log(a.pack_log)
    require_nodes(host, "DiffusersOffloadLoadDiffusionModelFile", "DiffusersOffloadGenerateImage")
    host.nodes.NODE_CLASS_MAPPINGS.update(bc.helper_nodes(rec))
    rec.install(mm)
    install_timers(rec, host.nodes, a.family)
    from benchkit.measure import Ballast, MemoryPoller, alloc_counts

    env = {"comfyui": host.version, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if cuda else None,
           "vram_state": str(mm.vram_state)}
    rows(section="env", **env, boot_s=boot_s, files=files, rss=host_rss(), args=vars(a))
    print(f"== ComfyUI {host.version} up in {boot_s:.1f} s", flush=True)
    c = SimpleNamespace(a=a, host=host, mm=mm, rec=rec, alloc_counts=alloc_counts, runs=[], poller=None,
                        ballast_used=0, storage=sum(v for k, v in files.items() if k in FOLDERS))
    ballast = Ballast(a.cap, card=True) if cuda and a.cap > 0 else None
    if ballast is not None:
        c.ballast_used = ballast.used
        rows(section="ballast", cap_gib=a.cap, card_gib=gib(ballast.card))
    if cuda:
        c.poller = MemoryPoller(a.poll_ms / 1000.0)
        c.poller.start()
    try:
        for side in a.side_list:
            unload_all(mm)  # each side's first run finds the other's models off the card
            for name in a.prompt_list:
                rows(**run_once(c, side, name))
    finally:
        if c.poller is not None:
            c.poller.stop()
        if ballast is not None:
            ballast.close()
    print_table(c, time.perf_counter() - t_start)
    rows.save()
    return 0 if not any(r["error"] for r in c.runs) else 1


def run_once(c: SimpleNamespace, side: str, name: str) -> dict[str, Any]:
    """One prompt through one side's branch, and what it took."""
    rec, torch = c.rec, c.rec.torch
    text, seed = PROMPTS[name]
    rec.begin_phase()
    counts0 = c.alloc_counts()
    if c.poller is not None:
        c.poller.reset()
    print(f"== {side} {name} (seed {seed})", flush=True)
    t0 = time.perf_counter()
    err = queue(c.host, workflow(c.a, text, seed), OUTPUTS[side], f"{side} {name}")
    wall = time.perf_counter() - t0
    got = rec.captured("ours_handle")
    if got is not None:
        rec.ours = getattr(got, "patcher", got)
    image = rec.captured(f"{side}_image")
    timed = {k: [s for who, s in rec.forwards if who == f"{side}{k}"] for k in ("", "_text", "_decode", "_load", "_place", "_pin")}
    forwards = timed[""]
    row = {"section": "run", "side": side, "prompt": name, "seed": seed, "error": err, "wall_s": round(wall, 3),
           "text_s": round(sum(timed["_text"]), 3), "text_calls": len(timed["_text"]),
           "decode_s": round(sum(timed["_decode"]), 3), "forward_s": [round(x, 4) for x in forwards],
           "denoise_s": round(sum(forwards), 3), "load_s": round(sum(timed["_load"]), 3),
           "place_s": round(sum(timed["_place"]), 3), "pin_s": [round(x, 3) for x in timed["_pin"]],
           "step_median_s": round(statistics.median(forwards[1:]), 4) if len(forwards) > 1 else None,
           "image_finite": None if image is None else bool(torch.isfinite(image).all()),
           **dict(zip(("torch_ooms", "alloc_retries"), map(int.__sub__, c.alloc_counts(), counts0), strict=True)),
           **host_rss(), "storage_gib": gib(c.storage), "log": rec.log[-30:]}
    row["other_s"] = round(wall - row["text_s"] - row["denoise_s"] - row["decode_s"], 3)
    if side == "ours" and rec.ours is not None:
        report = rec.ours.report()
        row["ours_pinned_gib"] = gib(report.pinned_bytes)
        row["ours_details"] = {c.name: c.details for c in report.components}  # graphs, plan, moves: run by run
    if c.poller is not None:
        c.poller.sample()
        row["peak_used_less_ballast_gib"] = gib(c.poller.peak - c.ballast_used)
    rec.capture.seen.clear()
    c.runs.append(row)
    print(f"   wall {wall:.2f} s: text {row['text_s']} s, denoise {row['denoise_s']} s "
          f"(step {row['step_median_s']}), decode {row['decode_s']} s, rest {row['other_s']} s (loading "
          f"{row['load_s']} s, placing {row['place_s']} s, of it pinning {row['pin_s']} s); error={err}", flush=True)
    return row


def print_table(c: SimpleNamespace, total_s: float) -> None:
    print("\n| side | run | wall s | text encode s | denoise s (step) | decode s | rest s | OOMs | peak GiB | RSS GiB (anon, file) |"
          "\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in c.runs:
        print(f"| {r['side']} | {r['prompt']} | {r['wall_s']:.2f} | {r['text_s']:.2f} | {r['denoise_s']:.2f} "
              f"({r['step_median_s']}) | {r['decode_s']:.2f} | {r['other_s']:.2f} | {r['torch_ooms']} "
              f"| {r.get('peak_used_less_ballast_gib')} | {r.get('rss_gib')} ({r.get('rss_anon_gib')}, "
              f"{r.get('rss_file_gib')}) |")
    print(f"\n(files {gib(c.storage)} GiB; the whole bench {total_s:.0f} s; errors: "
          f"{[r['error'] for r in c.runs if r['error']]})")


if __name__ == "__main__":
    sys.exit(main())

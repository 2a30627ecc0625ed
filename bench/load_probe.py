"""How long a Wan 2.1 14B-geometry single file (fp8_scaled or NVFP4, ComfyUI's layout, ``--layers``
blocks) takes to become a model on the host, and the host memory it takes: the pack's
``load_denoiser`` against ComfyUI's own ``load_diffusion_model`` (``--comfy-dir``: the tree, on the
CPU) and safetensors' ``load_file`` of the same file, each in a fresh process, file in the page
cache (a first read warms it). A load is host work: the CPU is where it is measured.

    .venv/bin/python bench/load_probe.py --comfy-dir /work/comfyui-2026 --layers 10 [--nvfp4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchkit import ROOT, gib, load_module, version_of
from benchkit.denoiser_files import write_fp8_scaled, write_nvfp4
from benchkit.single_file import TEXT_DIM, diffusers_config

ANCHOR = ROOT / ".gpu" / "native_anchor"
DIM, FFN = 5120, 13824


def build(out: Path, layers: int, nvfp4: bool) -> tuple[Path, Path]:
    """The file and a configs-only folder of its geometry, written once per geometry."""
    name = f"wan14b-{layers}l-{'nvfp4' if nvfp4 else 'fp8_scaled'}"
    file, config = out / f"{name}.safetensors", out / f"{name}-config"
    if not file.is_file():
        import diffusers
        import torch

        specs = load_module("make_wan_sd", ANCHOR / "make_wan_sd.py").wan_tensor_specs(DIM, FFN, layers,
                                                                                       text_dim=TEXT_DIM)
        out.mkdir(parents=True, exist_ok=True)
        (write_nvfp4 if nvfp4 else write_fp8_scaled)(file, specs, "cpu", 1, {"random_weights": "1"})
        with torch.device("meta"):
            diffusers.WanTransformer3DModel(**diffusers_config(DIM, FFN, layers)).save_config(config / "transformer")
    return file, config


def one_load(which: str, file: Path, config: Path, comfy_dir: str) -> dict:
    """In this (fresh) process, its libraries imported first: one load of ``file`` by ``which``;
    seconds, the bytes the model holds, the process's peak RSS (VmHWM: ru_maxrss survives exec) and
    its anonymous and file-backed (mapped, not yet read) resident bytes after the load."""
    if which == "comfyui":
        sys.argv = [sys.argv[0], "--cpu"]
        sys.path.insert(0, comfy_dir)
        import comfy.cli_args

        comfy.cli_args.args.cpu = True
        import comfy.sd

        load = lambda: comfy.sd.load_diffusion_model(str(file)).model  # noqa: E731
    elif which == "pack":
        import diffusers
        import torch
        from benchkit import pack

        pack()
        from diffusers_offload.offload_core.formats.single_file import load_denoiser

        assert diffusers.WanTransformer3DModel  # (diffusers imports its classes lazily)
        load = lambda: load_denoiser(file, config, torch.bfloat16)  # noqa: E731
    else:
        from safetensors.torch import load_file

        load = lambda: load_file(str(file))  # noqa: E731
    t0 = time.perf_counter()
    held = load()
    seconds = time.perf_counter() - t0
    tensors = held.values() if isinstance(held, dict) else held.state_dict().values()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"load": which, "s": round(seconds, 3), "held_gib": gib(sum(t.nbytes for t in tensors)),
            **{f"{k.lower()}_gib": gib(int(status[k].split()[0]) * 1024) for k in ("VmHWM", "RssAnon", "RssFile")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfy-dir", required=True)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--nvfp4", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/load_probe")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    file, config = build(Path(a.dir), a.layers, a.nvfp4)
    if a.one:
        print("ROW " + json.dumps(one_load(a.one, file, config, a.comfy_dir)), flush=True)
        return
    rows = []
    for which in ["safetensors", "pack", "comfyui"] * (a.repeats + 1):  # the first round warms the page cache
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", which], capture_output=True,
                             text=True, check=True)
        rows.append(json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("ROW "))[4:]))
    timed = rows[3:]
    summary = {w: {"median_s": statistics.median(r["s"] for r in timed if r["load"] == w),
                   "held_gib": next(r["held_gib"] for r in timed if r["load"] == w),
                   "vmhwm_gib": max(r["vmhwm_gib"] for r in timed if r["load"] == w)}
               for w in ("safetensors", "pack", "comfyui")}
    print(json.dumps({"file_gib": gib(file.stat().st_size), "layers": a.layers, "nvfp4": a.nvfp4,
                      "torch": version_of("torch"), "diffusers": version_of("diffusers"), "rows": rows,
                      "summary": summary}, indent=1))


if __name__ == "__main__":
    main()

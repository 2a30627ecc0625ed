"""GPU check of LoRA on quantized layers (issue 23.4): on CUDA, the tiny Wan with fp8-stored and
with GGUF Q8_0 transformer weights, LoRA on, in every mode (streamed with pinned memory and the
side stream, kept blocks, leaf, model, none): each mode's output equals mode none's bit for bit,
clearing the set gives the base output bit for bit, the unfused factors sit on the GPU, and a
release leaves nothing of ours.

    python3 bench/lora_quantized_check.py
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("diffusers_offload", ROOT / "__init__.py",
                                              submodule_search_locations=[str(ROOT)])
pack = importlib.util.module_from_spec(spec)
sys.modules["diffusers_offload"] = pack
spec.loader.exec_module(pack)
sys.path.insert(0, str(ROOT / "tests"))

from diffusers import GGUFQuantizationConfig, WanPipeline, WanTransformer3DModel  # noqa: E402
from diffusers_offload.offload_core import Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core.formats.fp8 import store_fp8  # noqa: E402
from diffusers_offload.offload_core.lora import LoraSpec, activate  # noqa: E402
from diffusers_offload.offload_core.state import leftovers  # noqa: E402
from fixtures.gguf_files import write_wan_gguf  # noqa: E402
from fixtures.tiny_loras import wan_lora  # noqa: E402
from fixtures.tiny_models import build_tiny_wan, load_wan, run_wan  # noqa: E402

COMMON = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", never=("text_encoder", "vae"))
MODES = {"auto": dict(mode="auto"), "auto-keep-some": dict(mode="auto", preload="0.0005"),
         "leaf": dict(mode="leaf"), "model": dict(mode="model"), "none": dict(mode="none")}


def fp8_pipe(folder: Path) -> WanPipeline:
    pipe = load_wan(folder)
    pipe.transformer.to(torch.bfloat16)
    store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16)
    return pipe


def gguf_pipe(folder: Path, file: Path) -> WanPipeline:
    transformer = WanTransformer3DModel.from_single_file(
        str(file), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
        config=str(folder), subfolder="transformer", torch_dtype=torch.bfloat16)
    pipe = WanPipeline.from_pretrained(folder, transformer=transformer, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def check(name: str, make, lora: Path) -> bool:
    outputs = {}
    ok = True
    for mode in ["none", *[m for m in MODES if m != "none"]]:
        pipe = make()
        engine = Engine()
        engine.place(pipe, OffloadConfig(**MODES[mode], **COMMON))
        activate(pipe, [LoraSpec(str(lora))])
        on = run_wan(pipe)
        engine.after_run(pipe)
        details = engine.report(pipe).component("transformer").details["lora"]
        gpu = torch.cuda.memory_allocated()
        activate(pipe, [])
        off = run_wan(pipe)
        engine.after_run(pipe)
        engine.release(pipe)
        left = leftovers(pipe.transformer)
        outputs.setdefault("on", on)
        outputs.setdefault("off", off)
        same = torch.equal(on, outputs["on"]) and torch.equal(off, outputs["off"])
        moved = (on - off).abs().max().item()
        ok &= same and not left and moved > 0.1
        print(f"{name:5} {mode:15} on==none {torch.equal(on, outputs['on'])} off==none {torch.equal(off, outputs['off'])} "
              f"lora moves {moved:.3f} path {details['path']} unfused {len(details.get('unfused', {}))} "
              f"factors {details.get('factor_bytes', 0)} B, allocated with LoRA {gpu} B, leftovers {left}")
    return ok


def main() -> None:
    root = Path(tempfile.mkdtemp())
    folder = build_tiny_wan(root / "wan")
    lora_fp8 = wan_lora(load_wan(folder).transformer, root / "lora-fp8", seed=1)
    lora_gguf = wan_lora(load_wan(folder).transformer, root / "lora-gguf", seed=5, targets=("to_q", "ffn.net.2"))
    gguf = write_wan_gguf(folder, root / "wan-Q8_0.gguf", "Q8_0")
    ok = check("fp8", lambda: fp8_pipe(folder), lora_fp8)
    ok &= check("gguf", lambda: gguf_pipe(folder, gguf), lora_gguf)
    print("ALL OK" if ok else "MISMATCH")


if __name__ == "__main__":
    main()

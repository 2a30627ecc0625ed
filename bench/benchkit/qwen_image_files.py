"""The three files a ComfyUI user holds for Qwen-Image, at full size with random weights, as
image_pipeline_node.py runs them: the transformer with its blocks' matrices in plain fp8 (Comfy-Org's
``qwen_image_fp8_e4m3fn``, written by native_image_anchor.py), the Qwen2.5-VL 7B text encoder in
ComfyUI's layout as Comfy-Org's ``qwen_2.5_vl_7b_fp8_scaled`` holds it (every Linear weight fp8 with a
per-tensor ``scale_weight``, the embedding and norms bf16, a ``scaled_fp8`` marker), and the VAE in
Wan 2.1's original layout (``qwen_image_vae``). Configs: the ones the pack carries. ``tiny``: the
suite's tiny Qwen-Image (a CPU check of ours only: ComfyUI's own text encoder has a fixed 7B shape).
Nothing here imports torch at module level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import ROOT, fixture, load_module
from .denoiser_files import write_fp8_scaled

CARRIED = ROOT / "offload_core" / "formats" / "carried_configs" / "Qwen-Image"
NAMES = {"denoiser": "qwen_image_fp8_random.safetensors",
         "text_encoder": "qwen_2.5_vl_7b_fp8_scaled_random.safetensors",
         "vae": "qwen_image_vae_random.safetensors"}
TINY_CONFIG = "qwen-image-tiny"  # the tiny folder's name under models/diffusers
FOLDERS = {"denoiser": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae"}  # ComfyUI's, by input
BF16_2D = ("embed_tokens.weight",)  # 2-D but not a Linear: bf16 in Comfy-Org's file


def text_encoder_specs(layers: int | None = None) -> list[tuple[str, tuple[int, ...], tuple]]:
    """(ComfyUI key, shape, init) of the carried Qwen2.5-VL text encoder, built on the meta device;
    ``layers``: the first ones only (a quicker build)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig.from_pretrained(CARRIED / "text_encoder")
    if layers:
        config.text_config.num_hidden_layers = layers
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    state = fixture("qwen_image_files").comfy_text_encoder_state(model.state_dict())
    return [(k, tuple(t.shape), init_of(k, t.ndim)) for k, t in state.items()]


def init_of(key: str, ndim: int) -> tuple:
    """A random weight's init by its name: norms ones, other vectors zeros, matrices normal(0.02)."""
    if ndim == 1 and "norm" in key:
        return ("ones",)
    if ndim == 1:
        return ("zeros",)
    return ("normal", 0.02)


def file_paths(models: Path, names: dict[str, str]) -> dict[str, Path]:
    """Where each of ``names``' files goes under ``models`` (ComfyUI's folder for its input), made."""
    paths = {name: models / folder / names[name] for name, folder in FOLDERS.items()}
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    return paths


def write_denoiser(path: Path, model_name: str, device: str) -> None:
    """The transformer file with fp8 blocks, as native_image_anchor.py writes it."""
    load_module("native_image_anchor", ROOT / "bench" / "native_image_anchor.py").write(path, model_name, None, device)


def write(models: Path, tiny: bool, device: str, te_layers: int | None = None) -> dict[str, Any]:
    """The three files under ``models`` (diffusion_models, text_encoders, vae); their sizes."""
    paths = file_paths(models, NAMES)
    if tiny:
        _write_tiny(paths, models)
    else:
        write_denoiser(paths["denoiser"], "qwenimage", device)
        write_fp8_scaled(paths["text_encoder"], text_encoder_specs(te_layers), device, seed=1, meta={}, bf16=BF16_2D)
        _write_vae(paths["vae"])
    return {name: p.stat().st_size for name, p in paths.items()}


def _write_vae(path: Path) -> None:
    import diffusers
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(2)
    vae = diffusers.AutoencoderKLQwenImage.from_config(json.loads((CARRIED / "vae" / "config.json").read_text()))
    state = {k: v.to(torch.bfloat16) for k, v in vae.state_dict().items()}
    save_file(fixture("qwen_image_files").wan21_vae_state(state), str(path))


def _write_tiny(paths: dict[str, Path], models: Path) -> None:
    from safetensors.torch import save_file

    f = fixture("qwen_image_files")
    folder = f.build_tiny_qwen_image(models / "diffusers" / TINY_CONFIG)
    save_file(f.transformer_state(folder), str(paths["denoiser"]))
    made = f.comfy_qwen_image_files(folder, models / "parts")
    for name in ("text_encoder", "vae"):
        made[name].replace(paths[name])

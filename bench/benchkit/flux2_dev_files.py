"""The three files a ComfyUI user holds for FLUX.2 [dev], at full size with random weights, as
image_pipeline_node.py runs them (``--family flux2``): the 32B transformer under BFL's names with its
blocks' matrices in plain fp8 (written by native_image_anchor.py), Mistral Small 3.1's language model
as Comfy-Org's pruned ``mistral_3_small_flux2_fp8`` holds it (the 30 layers FLUX.2 reads, no final
norm; every Linear weight fp8 with a per-tensor ``scale_weight``, the embedding and norms bf16, a
``scaled_fp8`` marker, the tekken vocabulary under ``tekken_model``: the suite's tiny one, which both
sides read), and the VAE as ``flux2-vae.safetensors`` holds it. Configs: the ones the pack carries.
``tiny``: the suite's tiny FLUX.2 [dev] (a CPU check of ours only). Nothing here imports torch at
module level.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from . import ROOT, fixture
from .denoiser_files import write_fp8_scaled
from .qwen_image_files import file_paths, init_of, write_denoiser

CARRIED = ROOT / "offload_core" / "formats" / "carried_configs" / "FLUX.2-dev"
NAMES = {"denoiser": "flux2_dev_fp8_random.safetensors",
         "text_encoder": "mistral_3_small_flux2_fp8_random.safetensors",
         "vae": "flux2_vae_random.safetensors"}
TINY_CONFIG = "flux2-dev-tiny"  # the tiny folder's name under models/diffusers
PRUNED = 30  # the layers FLUX.2 reads (hidden states 10, 20 and 30): what Comfy-Org's pruned file holds
BF16_2D = ("embed_tokens.weight",)


def text_encoder_specs(layers: int = PRUNED) -> list[tuple[str, tuple[int, ...], tuple]]:
    """(ComfyUI key, shape, init) of the carried Mistral language model to ``layers`` layers, without
    its final norm, built on the meta device."""
    import torch
    from transformers import MistralConfig, MistralModel

    config = MistralConfig.from_pretrained(CARRIED / "text_encoder")
    config.num_hidden_layers = layers
    with torch.device("meta"):
        model = MistralModel(config)
    return [(f"model.{k}", tuple(t.shape), init_of(k, t.ndim)) for k, t in model.state_dict().items()
            if not k.startswith("norm.")]


def write(models: Path, tiny: bool, device: str, te_layers: int | None = None) -> dict[str, Any]:
    """The three files under ``models`` (diffusion_models, text_encoders, vae); their sizes."""
    paths = file_paths(models, NAMES)
    if tiny:
        _write_tiny(paths, models)
    else:
        write_denoiser(paths["denoiser"], "flux2", device)
        tekken = fixture("tiny_tok").tiny_tekken()
        write_fp8_scaled(paths["text_encoder"], text_encoder_specs(te_layers or PRUNED), device, seed=1, meta={},
                         bf16=BF16_2D, raw={"tekken_model": tekken})
        _write_vae(paths["vae"])
    return {name: p.stat().st_size for name, p in paths.items()}


def _write_vae(path: Path) -> None:
    import diffusers
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(2)
    vae = diffusers.AutoencoderKLFlux2.from_config(json.loads((CARRIED / "vae" / "config.json").read_text()))
    with tempfile.TemporaryDirectory() as tmp:
        vae.to(torch.bfloat16).save_pretrained(Path(tmp) / "vae")
        save_file(fixture("flux2_klein_files").flux2_vae_state(Path(tmp)), str(path))


def _write_tiny(paths: dict[str, Path], models: Path) -> None:
    from safetensors.torch import save_file

    dev = fixture("flux2_dev_files")
    folder = dev.build_tiny_flux2_dev(models / "diffusers" / TINY_CONFIG)
    save_file(fixture("flux2_klein_files").transformer_state(folder), str(paths["denoiser"]))
    made = dev.comfy_flux2_dev_files(folder, models / "parts")
    for name in ("text_encoder", "vae"):
        made[name].replace(paths[name])

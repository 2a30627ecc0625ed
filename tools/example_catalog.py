"""What the shipped example workflows are: each one's template name, pipeline class, model folder,
tiny stand-in and Hub repository (single-file ones: the ComfyUI files it picks), and the tiny sizes the
tests and the demo run them at. Imports nothing from ComfyUI; ``offload_examples`` builds on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import single_file_examples as sf

GENERATE = ("DiffusersOffloadGenerateImage", "DiffusersOffloadGenerateVideo", "DiffusersOffloadGenerateH3")
SETTINGS = "DiffusersOffloadSettings"
# Tiny random-weight models: sizes that finish in seconds on a CPU, and no size floors, so every
# component gets the role a full-size one would (streamed denoiser, leaf text encoder, on-demand VAE).
TINY_SIZES = {"steps": 2, "width": 32, "height": 32, "frames": 9}
TINY_OVERRIDES = {
    **dict.fromkeys(GENERATE, TINY_SIZES),
    SETTINGS: {"resident_floor_mb": 0.0, "on_demand_threshold_gb": 0.0},
}
MODELS_DIR = "ComfyUI/models/diffusers"  # where the Notes tell users to put a model folder


@dataclass(frozen=True)
class Example:
    """One shipped chain: its file stem (the template's title), the pipeline class it is for, the
    folder name users have and the Hub repository it comes from."""

    name: str
    pipeline: str
    model: str
    tiny: str  # key of tests/fixtures/tiny_models.BUILDERS or of a tests/fixtures/*_files.py family (h3_ref, wan22_*: theirs)
    repo: str  # Hugging Face repository of the diffusers-format model
    title: str  # what the Note and the thumbnail call it
    tiny_extra: tuple[tuple[str, Any], ...] = ()  # Generate inputs on top of TINY_SIZES for this example
    skip: tuple[str, ...] = ()  # download globs: files of the repository this template never reads
    skip_what: str = ""  # what those globs leave out, for the Note
    gated: bool = False  # the repository asks users to accept its licence first
    files: tuple[sf.ComfyFile, ...] = ()  # single-file templates: ComfyUI files; repo gives configs only

    def tiny_overrides(self, **inputs: Any) -> dict[str, dict[str, Any]]:
        """TINY_OVERRIDES with this example's own Generate inputs, then ``inputs`` (e.g. steps=3)."""
        extra = {**dict(self.tiny_extra), **inputs}
        return {**TINY_OVERRIDES, **{node: {**TINY_OVERRIDES[node], **extra} for node in GENERATE}}

    def download_command(self) -> str:
        """The one command that puts the model where the loader lists it (run beside ComfyUI/)."""
        skips = "".join(f' --exclude "{glob}"' for glob in self.skip)
        return f"hf download {self.repo} --local-dir {MODELS_DIR}/{self.model}{skips}"


EXAMPLES = (
    Example("flux_text_to_image", "FluxPipeline", "FLUX.1-dev", "flux",
            repo="black-forest-labs/FLUX.1-dev", title="FLUX.1-dev: text to image",
            skip=("flux1-dev.safetensors", "ae.safetensors"), skip_what="the single-file checkpoints", gated=True),
    Example("wan_text_to_video", "WanPipeline", "Wan2.1-T2V-1.3B-Diffusers", "wan",
            repo="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", title="Wan 2.1: text to video"),
    Example("ltx2_text_to_video", "LTX2Pipeline", "LTX-2", "ltx2",
            repo="Lightricks/LTX-2", title="LTX-2: text to video with audio",
            skip=("ltx-2-*",), skip_what="the single-file checkpoints"),
    # H3 clips are 5-15 s (124 frames at least); the tiny audio VAE's 160 Hz cannot be muxed into AAC.
    Example("h3_first_last_to_video", "MiniMaxH3ModularPipeline", "MiniMax-H3", "h3",
            repo="MiniMaxAI/MiniMax-H3", title="MiniMax-H3: first and last frame to video",
            tiny_extra=(("frames", 124), ("generate_audio", False)),
            skip=("transformer_ref/*",), skip_what="the ref2va transformer"),
    Example("h3_still_image", "MiniMaxH3ModularPipeline", "MiniMax-H3", "h3",
            repo="MiniMaxAI/MiniMax-H3", title="MiniMax-H3: still image",
            tiny_extra=(("frames", 1),), skip=("transformer_ref/*",), skip_what="the ref2va transformer"),
    Example("h3_reference_to_video", "MiniMaxH3ModularPipeline", "MiniMax-H3", "h3_ref",
            repo="MiniMaxAI/MiniMax-H3", title="MiniMax-H3: reference image to video",
            tiny_extra=(("frames", 124), ("generate_audio", False)),
            skip=("transformer/*",), skip_what="the t2va/fl2va transformer"),
    Example("flux_schnell_single_files", "FluxPipeline", sf.AUTO_CONFIG, "flux",
            repo=sf.FLUX_SCHNELL_REPO, title="FLUX.1-schnell, single files: text to image",
            files=(sf.FLUX_SCHNELL, sf.FLUX_CLIP_L, sf.FLUX_T5XXL_FP8, sf.FLUX_AE)),
    Example("z_image_turbo_single_files", "ZImagePipeline", sf.AUTO_CONFIG, "z_image",
            repo=sf.Z_IMAGE_REPO, title="Z-Image Turbo, ComfyUI's files: text to image",
            files=(sf.Z_IMAGE_TURBO, sf.Z_IMAGE_QWEN3, sf.Z_IMAGE_AE)),
    Example("qwen_image_single_files", "QwenImagePipeline", sf.AUTO_CONFIG, "qwen_image",
            repo=sf.QWEN_IMAGE_REPO, title="Qwen-Image, ComfyUI's files: text to image",
            files=(sf.QWEN_IMAGE_FP8, sf.QWEN_IMAGE_TEXT_ENCODER, sf.QWEN_IMAGE_VAE)),
    Example("qwen_image_edit_single_files", "QwenImageEditPlusPipeline", sf.AUTO_CONFIG, "qwen_image_edit",
            repo=sf.QWEN_IMAGE_EDIT_REPO, title="Qwen-Image-Edit-2509, ComfyUI's files: edit an image",
            files=(sf.QWEN_IMAGE_EDIT_FP8, sf.QWEN_IMAGE_TEXT_ENCODER, sf.QWEN_IMAGE_VAE)),
    Example("flux2_klein_single_files", "Flux2KleinPipeline", sf.AUTO_CONFIG, "flux2_klein",
            repo=sf.FLUX2_KLEIN_REPO, title="FLUX.2 [klein] 4B, ComfyUI's files: text to image",
            files=(sf.FLUX2_KLEIN_FP8, sf.Z_IMAGE_QWEN3, sf.FLUX2_VAE)),
    Example("flux2_klein_edit_single_files", "Flux2KleinPipeline", sf.AUTO_CONFIG, "flux2_klein",
            repo=sf.FLUX2_KLEIN_REPO, title="FLUX.2 [klein] 4B, ComfyUI's files: edit an image",
            files=(sf.FLUX2_KLEIN_FP8, sf.Z_IMAGE_QWEN3, sf.FLUX2_VAE)),
    Example("flux2_dev_single_files", "Flux2Pipeline", sf.AUTO_CONFIG, "flux2_dev",
            repo=sf.FLUX2_DEV_REPO, title="FLUX.2 [dev], ComfyUI's files: text to image",
            files=(sf.FLUX2_DEV_FP8, sf.FLUX2_DEV_MISTRAL, sf.FLUX2_VAE)),
    Example("ltx2_single_files", "LTX2Pipeline", sf.AUTO_CONFIG, "ltx2_checkpointable",
            repo=sf.LTX2_REPO, title="LTX-2 19B, ComfyUI's files: text to video with audio",
            files=(sf.LTX2_FP8, sf.LTX2_GEMMA_FP4), tiny_extra=(("width", 64), ("height", 64))),
    Example("wan_fp8_scaled_single_file", "WanPipeline", sf.AUTO_CONFIG, "wan",
            repo="Wan-AI/Wan2.1-T2V-14B-Diffusers", title="Wan 2.1 14B, fp8_scaled file: text to video",
            files=(sf.WAN_14B_FP8_SCALED, sf.WAN_TEXT_ENCODER, sf.WAN_VAE)),
    Example("wan_gguf_single_file", "WanPipeline", sf.AUTO_CONFIG, "wan",
            repo="Wan-AI/Wan2.1-T2V-14B-Diffusers", title="Wan 2.1 14B, GGUF Q8_0 file: text to video",
            files=(sf.WAN_14B_GGUF_Q8_0, sf.WAN_TEXT_ENCODER, sf.WAN_VAE)),
    Example("wan22_a14b_single_files", "WanPipeline", sf.AUTO_CONFIG, "wan22_a14b",
            repo="Wan-AI/Wan2.2-T2V-A14B-Diffusers", title="Wan 2.2 A14B, two fp8_scaled experts: text to video",
            files=(sf.WAN22_HIGH_FP8_SCALED, sf.WAN22_LOW_FP8_SCALED, sf.WAN_TEXT_ENCODER, sf.WAN_VAE)),
    Example("wan22_a14b_i2v_single_files", "WanImageToVideoPipeline", sf.AUTO_CONFIG, "wan22_a14b_i2v",
            repo="Wan-AI/Wan2.2-I2V-A14B-Diffusers", title="Wan 2.2 A14B, two fp8_scaled experts: image to video",
            files=(sf.WAN22_I2V_HIGH_FP8_SCALED, sf.WAN22_I2V_LOW_FP8_SCALED, sf.WAN_TEXT_ENCODER, sf.WAN_VAE)),
)


def example(name: str) -> Example:
    for ex in EXAMPLES:
        if ex.name == name:
            return ex
    raise KeyError(f"no example {name!r}; shipped: {', '.join(e.name for e in EXAMPLES)}")


def example_for_model(folder: Path) -> Example:
    """The first example whose pipeline class the folder's index (classic or modular) names."""
    indexes = [Path(folder) / f for f in ("model_index.json", "modular_model_index.json")]
    found = [p for p in indexes if p.is_file()]
    if not found:
        raise ValueError(f"{folder} is not a diffusers pipeline folder: it has no model_index.json")
    index = json.loads(found[0].read_text(encoding="utf-8"))
    for ex in EXAMPLES:
        if ex.pipeline == index.get("_class_name"):
            return ex
    raise ValueError(
        f"{folder} holds a {index.get('_class_name')}; the examples run "
        f"{', '.join(e.pipeline for e in EXAMPLES)}"
    )

"""Wan 2.1 image-to-video from single files, as ComfyUI users hold it: the denoiser, the text
encoder, the VAE and the CLIP vision encoder (Comfy-Org's ``clip_vision_h.safetensors``, in
transformers' key names) beside a configs-only I2V folder; the image-to-video run is the folder's
pipeline's with the same denoiser.
A configs-only I2V folder without the image-encoder file names it; a text encoder given as the
image encoder is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats.inspect import SingleFileError
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from fixtures.comfy_files import configs_only_copy, write_comfy_wan, write_component_file
from fixtures.placements import run_placed
from fixtures.tiny_wan_families import run_wan_family
from safetensors.torch import load_file, save_file

BF16 = torch.bfloat16
CONFIG = OffloadConfig(mode="auto", on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


@pytest.fixture(scope="module")
def i2v(tiny_wan_family, tmp_path_factory) -> dict[str, Path]:
    """The tiny Wan 2.1 I2V folder, its configs-only copy, the denoiser in ComfyUI's key layout (bf16),
    the other components' weights as one file each, and the image encoder as Comfy-Org's
    clip_vision_h file holds it too (``vision_model.`` names, a ``visual_projection``)."""
    folder = tiny_wan_family("wan_i2v")
    root = tmp_path_factory.mktemp("wan-i2v-files")
    files = {name: write_component_file(folder, name, root / f"{name}.safetensors")
             for name in ("text_encoder", "vae", "image_encoder")}
    files["transformer"] = write_comfy_wan(folder, root / "wan-i2v-tiny-bf16.safetensors", "bf16")
    state = load_file(str(files["image_encoder"]))
    comfy = {"vision_model." + k: v for k, v in state.items()}
    comfy["visual_projection.weight"] = torch.zeros(8, state["post_layernorm.weight"].shape[0])
    save_file(comfy, str(root / "clip_vision_tiny.safetensors"))
    return {"folder": folder, "configs": configs_only_copy(folder, root / "configs"), **files,
            "clip_vision": root / "clip_vision_tiny.safetensors"}


def _load(i2v: dict[str, Path], image_encoder: Path | None):
    return load_pipeline_with_denoiser(i2v["configs"], i2v["transformer"], BF16, i2v["text_encoder"], i2v["vae"],
                                       image_encoder_file=image_encoder)


def _run(pipe) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    return run_placed(pipe, CONFIG, run_wan_family)


@pytest.mark.parametrize("layout", ["clip_vision", "image_encoder"])  # ComfyUI's file, transformers' own
def test_the_image_to_video_run_is_the_folders(i2v, layout) -> None:
    pipe = _load(i2v, i2v[layout])
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and type(pipe.image_encoder).__name__ == "CLIPVisionModel"
    folder = DiffusionPipeline.from_pretrained(str(i2v["folder"]), dtype=BF16)
    folder.register_modules(transformer=load_denoiser(i2v["transformer"], i2v["folder"], BF16))  # the same denoiser
    assert torch.equal(_run(pipe), _run(folder))


def test_a_configs_only_i2v_folder_names_the_image_encoder_file_to_pick(i2v) -> None:
    with pytest.raises(SingleFileError, match=r"no weights for image_encoder \(CLIPVisionModel\): pick an "
                                              r"image-encoder file"):
        _load(i2v, None)


def test_a_text_encoder_given_as_the_image_encoder_is_refused_by_name(i2v) -> None:
    with pytest.raises(SingleFileError, match=r"text_encoder\.safetensors looks like a T5/UMT5 text encoder, not an "
                                              r"image-encoder file"):
        _load(i2v, i2v["text_encoder"])

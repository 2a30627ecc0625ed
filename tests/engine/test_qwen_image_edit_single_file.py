"""Qwen-Image-Edit from ComfyUI's files alone: the edit denoiser (Comfy-Org's ``qwen_image_edit_*``
files, diffusers' names; 2511's with ComfyUI's ``__index_timestep_zero__`` marker), the Qwen2.5-VL text
encoder in ComfyUI's layout with its vision tower (through which the pipeline reads the reference
images) and the VAE in Wan 2.1's original layout, with configs like the pack's carried edit folders:
configs only, the processor's image configs without a tokenizer, which the loader builds around
ComfyUI's own tokenizer. Each placement gives the bits of the folder's own pipeline holding the
file's weights as ComfyUI computes them; a text encoder without the vision tower is refused by name."""

from __future__ import annotations

from pathlib import Path

import diffusers
import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats import carried
from diffusers_offload.offload_core.formats.inspect import SingleFileError
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from fixtures.comfy_files import carried_like_with_tokenizers, comfy_dequantised, comfy_tensors
from fixtures.placements import PLACEMENTS, run_placed
from fixtures.quantized import digest
from fixtures.qwen_image_edit_files import build_tiny_qwen_image_edit, references, run_qwen_image_edit
from fixtures.qwen_image_files import comfy_qwen_image_files, transformer_state
from safetensors.torch import load_file, save_file

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_qwen_image_edit(tmp_path_factory.mktemp("qwen-image-edit") / "qwen-image-edit-tiny")


@pytest.fixture(scope="module")
def denoiser(folder, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen-image-edit-files") / "qwen_image_edit_2509_tiny_fp8_scaled.safetensors"
    save_file(comfy_tensors(transformer_state(folder), "fp8_scaled"), str(path))
    return path


@pytest.fixture(scope="module")
def parts(folder, tmp_path_factory) -> dict[str, Path]:
    return comfy_qwen_image_files(folder, tmp_path_factory.mktemp("qwen-image-edit-parts"))


@pytest.fixture(scope="module")
def carried_like(folder, tmp_path_factory) -> tuple[Path, Path]:
    return carried_like_with_tokenizers(folder, tmp_path_factory.mktemp("qwen-image-edit-carried"),
                                        "Qwen-Image-Edit-2509")


def _reference(folder: Path, transformer: dict, images: list | None = None) -> torch.Tensor:
    """The folder's own pipeline (no pack code) in bf16, its transformer holding ``transformer``."""
    pipe = diffusers.DiffusionPipeline.from_pretrained(str(folder), dtype=BF16)
    pipe.transformer.load_state_dict(transformer, strict=True)
    return run_qwen_image_edit(pipe, images)


@pytest.fixture(scope="module")
def expected(folder, denoiser) -> torch.Tensor:
    return _reference(folder, comfy_dequantised(denoiser, BF16))


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_comfyuis_edit_files_run_with_carried_like_configs_in_every_placement(placement, folder, denoiser, parts,
                                                                             carried_like, expected):
    configs, package = carried_like
    assert not (configs / "processor" / "tokenizer.json").exists()
    before = {p: digest(p) for p in (denoiser, *parts.values())}
    assert carried.pick(denoiser, False, configs.parent) == configs
    pipe = load_pipeline_with_denoiser(configs, denoiser, BF16, comfy_tokenizers=package,
                                       text_encoder_file=parts["text_encoder"], vae_file=parts["vae"])
    assert type(pipe).__name__ == "QwenImageEditPlusPipeline" and pipe.processor.tokenizer is pipe.tokenizer
    assert pipe.transformer.transformer_blocks[0].attn.to_q.weight.dtype == FP8
    assert torch.equal(run_placed(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), run_qwen_image_edit), expected)
    assert {p: digest(p) for p in before} == before


def test_a_2511_file_with_comfyuis_marker_runs_its_reference_at_timestep_zero(tmp_path):
    """Edit-2511: a transformer with ``zero_cond_t``, its file carrying ComfyUI's empty
    ``__index_timestep_zero__`` marker. It picks the 2511 configs (not 2509's, which it would fit but
    for the marker), loads without the marker and gives the folder's own bits, which differ from the
    same weights run as 2509 (the reference latents at the step's timestep)."""
    edit_2511 = build_tiny_qwen_image_edit(tmp_path / "qwen-image-edit-2511-tiny", zero_cond_t=True)
    path = tmp_path / "qwen_image_edit_2511_tiny_bf16.safetensors"
    state = transformer_state(edit_2511)
    save_file({**comfy_tensors(state, "bf16"), "__index_timestep_zero__": torch.empty(0)}, str(path))
    configs, package = carried_like_with_tokenizers(edit_2511, tmp_path / "carried", "Qwen-Image-Edit-2511")
    assert carried.pick(path, False, configs.parent) == configs
    pipe = load_pipeline_with_denoiser(configs, path, BF16, comfy_tokenizers=package, **_parts(edit_2511, tmp_path))
    assert pipe.transformer.config.zero_cond_t
    got = run_placed(pipe, OffloadConfig(**PLACEMENTS["auto"], **BASE), run_qwen_image_edit)
    want = _reference(edit_2511, {k: t.to(BF16) for k, t in load_file(str(path)).items() if k in state})
    assert torch.equal(got, want)
    pipe.transformer.register_to_config(zero_cond_t=False)
    pipe.transformer.zero_cond_t = False
    assert not torch.equal(run_qwen_image_edit(pipe), want)


def _parts(folder: Path, out: Path) -> dict[str, Path]:
    files = comfy_qwen_image_files(folder, out / "parts")
    return {"text_encoder_file": files["text_encoder"], "vae_file": files["vae"]}


def test_one_reference_image_runs_the_first_edit_models_pipeline(folder, denoiser, parts, tmp_path):
    """The first Qwen-Image-Edit (``QwenImageEditPipeline``): one reference image, the same parts."""
    edit = build_tiny_qwen_image_edit(tmp_path / "qwen-image-edit-v1-tiny", pipeline="QwenImageEditPipeline")
    path = tmp_path / "qwen_image_edit_tiny_fp8_scaled.safetensors"
    save_file(comfy_tensors(transformer_state(edit), "fp8_scaled"), str(path))
    configs, package = carried_like_with_tokenizers(edit, tmp_path / "carried", "Qwen-Image-Edit")
    pipe = load_pipeline_with_denoiser(configs, path, BF16, comfy_tokenizers=package, **_parts(edit, tmp_path))
    assert type(pipe).__name__ == "QwenImageEditPipeline"
    one = references()[:1]
    got = run_placed(pipe, OffloadConfig(**PLACEMENTS["auto"], **BASE), lambda p: run_qwen_image_edit(p, one))
    assert torch.equal(got, _reference(edit, comfy_dequantised(path, BF16), one))


def test_a_text_encoder_without_its_vision_tower_is_refused_by_name(folder, denoiser, parts, carried_like, tmp_path):
    """Edit pipelines read their references through the vision tower: a text-only Qwen2.5-VL file
    (as a GGUF one loads) is refused when the pipeline is built, naming the file and what it lacks."""
    text_only = tmp_path / "qwen_2.5_vl_text_only.safetensors"
    save_file({k: t for k, t in load_file(str(parts["text_encoder"])).items() if not k.startswith("visual.")},
              str(text_only))
    configs, package = carried_like
    with pytest.raises(SingleFileError, match=r"qwen_2.5_vl_text_only.safetensors holds no vision tower \(visual"
                                              r"\.\*\), through which QwenImageEditPlusPipeline reads"):
        load_pipeline_with_denoiser(configs, denoiser, BF16, comfy_tokenizers=package, text_encoder_file=text_only,
                                    vae_file=parts["vae"])


def test_the_prompt_cache_keys_the_reference_images_by_content(folder, denoiser, parts, carried_like, expected):
    """The edit pipelines encode the prompt with the reference images (the vision tower reads them):
    the same prompt with other images is a miss, giving those images' bits, and the first images
    again a hit, giving the first bits."""
    from diffusers_offload.offload_core import Engine
    from diffusers_offload.offload_core.state import PROMPT_CACHE

    configs, package = carried_like
    pipe = load_pipeline_with_denoiser(configs, denoiser, BF16, comfy_tokenizers=package,
                                       text_encoder_file=parts["text_encoder"], vae_file=parts["vae"])
    swapped = references()[::-1]
    engine = Engine()
    engine.place(pipe, OffloadConfig(**PLACEMENTS["auto"], **BASE))
    try:
        first, other, again = (run_qwen_image_edit(pipe, images) for images in (None, swapped, None))
        cache = PROMPT_CACHE.get(pipe)
        counts = (cache.hits, cache.misses, len(cache.entries))
    finally:
        engine.release(pipe)
    assert torch.equal(first, expected) and torch.equal(again, expected)
    assert torch.equal(other, _reference(folder, comfy_dequantised(denoiser, BF16), swapped))
    assert counts == (1, 2, 2)

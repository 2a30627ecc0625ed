"""The Qwen-Image configs the pack carries: Qwen-Image's folder builds the released sizes, its Edit,
Edit-2509 and Edit-2511 folders are the same models under their edit pipelines with Qwen2.5-VL's image
processor, and a Qwen-Image file picks its folder by shape, then by name (Comfy-Org's names)."""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import pytest
import transformers
from diffusers_offload.offload_core.formats import carried
from diffusers_offload.offload_core.formats.inspect import SingleFileError, describe_keys
from fixtures.carried_checks import billions, meta_model, pipeline_index

QWEN_IMAGE_TRANSFORMER, QWEN25_VL_7B = 20.430, 8.292  # qwen_image_bf16, qwen_2.5_vl_7b (vision tower and head)
QWEN_IMAGE_VAE = 0.127  # qwen_image_vae (wan_2.1_vae's size)


def test_the_carried_qwen_image_folder_builds_the_released_model_sizes() -> None:
    """Qwen-Image: its transformer, Qwen2.5-VL-7B with its vision tower and head (ComfyUI's
    ``qwen_2.5_vl_7b`` file), Wan 2.1's VAE size; the dynamic exponential shift; ComfyUI's Qwen folder."""
    folder = carried.by_name("Qwen-Image")
    pipeline_index(folder)
    assert billions(meta_model(diffusers.QwenImageTransformer2DModel, folder / "transformer")) == pytest.approx(
        QWEN_IMAGE_TRANSFORMER, rel=5e-3)
    assert billions(meta_model(transformers.Qwen2_5_VLForConditionalGeneration, folder / "text_encoder")) == pytest.approx(
        QWEN25_VL_7B, rel=5e-3)
    assert billions(meta_model(diffusers.AutoencoderKLQwenImage, folder / "vae")) == pytest.approx(QWEN_IMAGE_VAE, rel=5e-3)
    config = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder / "scheduler")).config
    assert (config.use_dynamic_shifting, config.max_shift, config.shift_terminal, config.time_shift_type) == (
        True, 0.9, 0.02, "exponential")
    assert json.loads((folder / "tokenizers.json").read_text()) == {"tokenizer": {"comfyui": "text_encoders/qwen25_tokenizer"}}


@pytest.mark.parametrize("name", ["Qwen-Image-Edit", "Qwen-Image-Edit-2509", "Qwen-Image-Edit-2511"])
def test_each_carried_qwen_image_edit_folder_is_qwen_image_with_its_edit_pipeline_and_processor(name: str) -> None:
    """The edit models: Qwen-Image's transformer (2511's with its reference at timestep 0), text
    encoder, VAE and scheduler, their edit pipeline, and Qwen2.5-VL's image processor (no tokenizer:
    the pipeline's, ComfyUI's, is put in it)."""
    folder, base = carried.by_name(name), carried.by_name("Qwen-Image")
    index = pipeline_index(folder)
    assert index["_class_name"] == ("QwenImageEditPipeline" if name == "Qwen-Image-Edit" else "QwenImageEditPlusPipeline")
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    config = diffusers.QwenImageTransformer2DModel.load_config(str(folder / "transformer"))
    assert config["zero_cond_t"] == name.endswith("2511")
    assert {**config, "zero_cond_t": False} == diffusers.QwenImageTransformer2DModel.load_config(str(base / "transformer"))
    for part in ("text_encoder", "vae", "scheduler"):
        assert {p.name: p.read_text() for p in (folder / part).iterdir()} == {
            p.name: p.read_text() for p in (base / part).iterdir()}
    images = transformers.AutoImageProcessor.from_pretrained(str(folder / "processor"))
    assert (type(images).__name__, images.patch_size, images.merge_size, images.size["longest_edge"]) == (
        "Qwen2VLImageProcessor", 14, 2, 12845056)
    assert not any((folder / "processor").glob("tokenizer*"))
    assert json.loads((folder / "tokenizers.json").read_text()) == {"tokenizer": {"comfyui": "text_encoders/qwen25_tokenizer"}}


@pytest.mark.parametrize(("file", "folder"), [
    ("qwen_image_fp8_e4m3fn.safetensors", "Qwen-Image"), ("qwen_image_2512_fp8_e4m3fn.safetensors", "Qwen-Image"),
    ("qwen_image_edit_fp8_e4m3fn.safetensors", "Qwen-Image-Edit"),
    ("qwen_image_edit_2509_fp8_e4m3fn.safetensors", "Qwen-Image-Edit-2509"),
    ("Qwen-Image-Edit-2509-Q4_K_M.safetensors", "Qwen-Image-Edit-2509"),
    ("qwen_image_edit_2511_bf16.safetensors", "Qwen-Image-Edit-2511")])
def test_a_qwen_image_file_picks_its_folder_by_shape_then_name(file: str, folder: str) -> None:
    """Qwen-Image, its 2512 update, Edit and Edit-2509 share every shape and are told by the file's
    name (Comfy-Org's names); Edit-2511 by ComfyUI's zero-timestep reference key, whatever its name."""
    shapes = {k: tuple(t.shape) for k, t in
              meta_model(diffusers.QwenImageTransformer2DModel, carried.by_name("Qwen-Image") / "transformer"
                    ).state_dict().items()}
    flag = {"__index_timestep_zero__": (0,)} if "2511" in file else {}
    info = describe_keys(Path(file), {**shapes, **flag})
    assert info.family == "qwen-image" and carried.choose(info, False, carried.carried()) == carried.by_name(folder)


def test_other_qwen_image_variants_fit_none() -> None:
    """Qwen-Image 2.1 is told by family; Qwen-Image-Layered (an extra time input) fits no carried folder."""
    shapes = {k: tuple(t.shape) for k, t in
              meta_model(diffusers.QwenImageTransformer2DModel, carried.by_name("Qwen-Image") / "transformer"
                    ).state_dict().items()}
    layered = describe_keys(Path("qwen_image_layered_bf16.safetensors"),
                            {**shapes, "time_text_embed.addition_t_embedding.weight": (2, 3072)})
    with pytest.raises(SingleFileError, match="60 blocks of width 3072.*an extra time input .Qwen-Image-Layered"):
        carried.choose(layered, False, carried.carried())
    newer = describe_keys(Path("qwen_image_2.1.safetensors"), {**shapes, "txt_in.text_norm.weight": (3584,)})
    with pytest.raises(SingleFileError, match="looks like a qwen-image-2 denoiser: the pack carries configs for"):
        carried.choose(newer, False, carried.carried())

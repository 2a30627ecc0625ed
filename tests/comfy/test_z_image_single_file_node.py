"""A Z-Image fp8_scaled file in ComfyUI's layout (Comfy-Org's ``z_image_turbo`` files) in a real
ComfyUI: listed from an extra diffusion_models path, loaded by Load diffusion model file into a
Z-Image diffusers folder (models/diffusers), reported as fp8 storage, and run through Generate
image; the file is unchanged. The tokenizer of the Z-Image Turbo configs the pack carries, read from
the running ComfyUI's own folder, gives the ids ComfyUI's Z-Image tokenizer gives. (Engine level, bit
for bit, the carried configs too: tests/engine/test_z_image_single_file.py.)"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from comfyhost import harness
from fixtures.comfy_files import comfy_tensors
from fixtures.z_image_files import build_tiny_z_image, comfy_z_image_state
from safetensors.torch import save_file

pytest_plugins = ["comfyhost.fixtures"]
LOADER = "DiffusersOffloadLoadDiffusionModelFile"
FILE = "z_image_tiny_fp8_scaled.safetensors"


def test_a_z_image_fp8_scaled_file_loads_into_a_z_image_folder_and_generates(comfy: harness.ComfyHost,
                                                                            tmp_path: Path) -> None:
    fp = comfy.folder_paths
    folder = build_tiny_z_image(Path(fp.get_folder_paths("diffusers")[0]) / "tiny" / "z-image")
    extra = tmp_path / "extra-diffusion-models"
    extra.mkdir()
    save_file(comfy_tensors(comfy_z_image_state(folder), "fp8_scaled"), str(extra / FILE))
    fp.add_model_folder_path("diffusion_models", str(extra))
    before = hashlib.sha256((extra / FILE).read_bytes()).hexdigest()
    _type, opts = comfy.nodes.NODE_CLASS_MAPPINGS[LOADER].INPUT_TYPES()["required"]["denoiser"]
    assert FILE in opts["options"]
    load = {"config": "tiny/z-image", "denoiser": FILE, "text_encoder": "none", "vae": "none", "dtype": "bf16"}
    gen = {"pipe": ["1", 0], "prompt": "a red fox", "negative_prompt": "", "seed": 0, "steps": 2, "guidance": 0.0,
           "width": 32, "height": 32, "batch_size": 1}
    result = comfy.run_prompt({
        "1": {"class_type": LOADER, "inputs": load},
        "2": {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": ["1", 0]}},
        "3": {"class_type": "DiffusersOffloadGenerateImage", "inputs": gen},
        "4": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
        "5": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}},
    })
    result.raise_for_error()
    report = "".join(result.outputs["4"]["text"])
    assert "ZImagePipeline" in report and "fp8" in report, report
    assert len(result.outputs["5"]["images"]) == 1
    assert hashlib.sha256((extra / FILE).read_bytes()).hexdigest() == before
    shutil.rmtree(folder)  # (the diffusers folder is the session's: leave no model behind)


def test_the_carried_z_image_tokenizer_reads_prompts_as_comfyuis_z_image_tokenizer(comfy: harness.ComfyHost) -> None:
    """ZImagePipeline's reading of a prompt (the chat template, then the tokenizer) with the carried
    Z-Image Turbo folder's tokenizer (ComfyUI's ``qwen25_tokenizer`` with Qwen3's template) gives
    the ids of ComfyUI's own Z-Image tokenizer (its prompt template), no system prompt."""
    try:
        from comfy.text_encoders.z_image import ZImageTokenizer
    except ImportError:
        pytest.skip("this ComfyUI tree has no Z-Image text encoder")
    carried = comfy.pack_submodule("offload_core.formats.carried")
    package = comfy.pack_submodule("nodes.model_files").comfy_package()
    ours = carried.shipped_tokenizer(carried.by_name("Z-Image-Turbo"), "tokenizer", "Qwen2Tokenizer", package)
    theirs = ZImageTokenizer()
    for prompt in ("a red fox in the snow", "Ünïcødé — 東京の夜, neon signs", "two cats, one dog"):
        text = ours.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                        add_generation_prompt=True, enable_thinking=True)
        ids = [token[0] for token in theirs.tokenize_with_weights(prompt)["qwen3_4b"][0]]
        assert ours(text)["input_ids"] == ids, (text, ids)

"""A Z-Image fp8_scaled file in ComfyUI's layout (Comfy-Org's ``z_image_turbo`` files) in a real
ComfyUI: listed from an extra diffusion_models path, loaded by Load diffusion model file into a
Z-Image diffusers folder (models/diffusers), reported as fp8 storage, and run through Generate
image; the file is unchanged. (The carried tokenizer: tests/comfy/test_carried_tokenizers.py; engine
level, bit for bit, the carried configs too: tests/engine/test_z_image_single_file.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

from comfyhost import harness
from comfyhost.single_files import generate_from_files
from fixtures.comfy_files import comfy_tensors
from fixtures.z_image_files import build_tiny_z_image, comfy_z_image_state
from safetensors.torch import save_file

pytest_plugins = ["comfyhost.fixtures"]


def test_a_z_image_fp8_scaled_file_loads_into_a_z_image_folder_and_generate(comfy: harness.ComfyHost,
                                                                            tmp_path: Path) -> None:
    folder = build_tiny_z_image(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]) / "tiny" / "z-image")
    denoiser = tmp_path / "z_image_tiny_fp8_scaled.safetensors"
    save_file(comfy_tensors(comfy_z_image_state(folder), "fp8_scaled"), str(denoiser))
    report = generate_from_files(comfy, "tiny/z-image", denoiser, {}, {"negative_prompt": "", "guidance": 0.0}, tmp_path)
    assert "ZImagePipeline" in report and "fp8" in report, report
    shutil.rmtree(folder)  # (the diffusers folder is the session's: leave no model behind)

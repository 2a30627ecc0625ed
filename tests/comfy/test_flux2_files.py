"""FLUX.2 [klein] and [dev] from ComfyUI's files in a real ComfyUI: an fp8_scaled denoiser (BFL's names)
from an extra diffusion_models path, the text encoder (Klein's Qwen3; [dev]'s Mistral, carrying its
tekken vocabulary) from text_encoders and the VAE (``flux2-vae``'s layout) from vae, loaded by Load
diffusion model file into a FLUX.2 diffusers folder and run through Generate image; the files are
unchanged. (The carried tokenizers: tests/comfy/test_carried_tokenizers.py; engine level, bit for
bit, every placement: tests/engine/test_flux2_klein_single_file.py, test_flux2_dev_single_file.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

from comfyhost import harness
from comfyhost.single_files import generate_from_files
from fixtures.comfy_files import comfy_tensors
from fixtures.flux2_klein_files import build_tiny_flux2_klein, comfy_flux2_klein_files, transformer_state
from safetensors.torch import save_file

pytest_plugins = ["comfyhost.fixtures"]


def test_comfyuis_klein_files_load_into_a_klein_folder_and_generate(comfy: harness.ComfyHost, tmp_path: Path) -> None:
    folder = build_tiny_flux2_klein(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]) / "tiny" / "flux2-klein")
    denoiser = tmp_path / "flux-2-klein-tiny-fp8_scaled.safetensors"
    save_file(comfy_tensors(transformer_state(folder), "fp8_scaled"), str(denoiser))
    parts = comfy_flux2_klein_files(folder, tmp_path / "parts")
    report = generate_from_files(comfy, "tiny/flux2-klein", denoiser, parts, {"negative_prompt": "", "guidance": 1.0},
                                 tmp_path)
    assert "Flux2KleinPipeline" in report and "fp8" in report, report
    shutil.rmtree(folder)


def test_comfyuis_flux2_dev_files_load_into_a_dev_folder_and_generate(comfy: harness.ComfyHost, tmp_path: Path) -> None:
    """FLUX.2 [dev]: the Mistral file (its tekken vocabulary beside the folder's tokenizer) and the
    flux2-vae file with a FLUX.2 [dev] folder, guidance 4 (the transformer's guidance input)."""
    from fixtures.flux2_dev_files import build_tiny_flux2_dev, comfy_flux2_dev_files

    folder = build_tiny_flux2_dev(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]) / "tiny" / "flux2-dev")
    denoiser = tmp_path / "flux2-dev-tiny-fp8_scaled.safetensors"
    save_file(comfy_tensors(transformer_state(folder), "fp8_scaled"), str(denoiser))
    parts = comfy_flux2_dev_files(folder, tmp_path / "parts")
    report = generate_from_files(comfy, "tiny/flux2-dev", denoiser, parts, {"negative_prompt": "", "guidance": 4.0},
                                 tmp_path)
    assert "Flux2Pipeline" in report and "fp8" in report, report
    shutil.rmtree(folder)

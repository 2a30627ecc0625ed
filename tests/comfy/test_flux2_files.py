"""FLUX.2 [klein] and [dev] from ComfyUI's files in a real ComfyUI: an fp8_scaled denoiser (BFL's names)
from an extra diffusion_models path, the text encoder (Klein's Qwen3; [dev]'s Mistral, carrying its
tekken vocabulary) from text_encoders and the VAE (``flux2-vae``'s layout) from vae, loaded by Load
diffusion model file into a FLUX.2 diffusers folder and run through Generate image; the files are
unchanged. (The carried tokenizers: tests/comfy/test_carried_tokenizers.py; engine level, bit for
bit, every placement: tests/engine/test_flux2_klein_single_file.py, test_flux2_dev_single_file.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from comfyhost import harness
from comfyhost.single_files import generate_from_files
from fixtures.comfy_files import comfy_tensors
from fixtures.flux2_dev_files import build_tiny_flux2_dev, comfy_flux2_dev_files
from fixtures.flux2_klein_files import build_tiny_flux2_klein, comfy_flux2_klein_files, transformer_state
from safetensors.torch import save_file

pytest_plugins = ["comfyhost.fixtures"]


@pytest.mark.parametrize(("variant", "guidance", "pipeline"), [("klein", 1.0, "Flux2KleinPipeline"),
                                                              ("dev", 4.0, "Flux2Pipeline")])
def test_comfyuis_flux2_files_load_into_a_flux2_folder_and_generate(comfy: harness.ComfyHost, tmp_path: Path,
                                                                    variant: str, guidance: float, pipeline: str) -> None:
    """[klein]: Qwen3 and flux2-vae with a Klein folder, guidance 1; [dev]: the Mistral file (its
    tekken vocabulary beside the folder's tokenizer) and flux2-vae with a [dev] folder, guidance 4
    (the transformer's guidance input)."""
    build, comfy_parts = {"klein": (build_tiny_flux2_klein, comfy_flux2_klein_files),
                          "dev": (build_tiny_flux2_dev, comfy_flux2_dev_files)}[variant]
    folder = build(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]) / "tiny" / f"flux2-{variant}")
    denoiser = tmp_path / f"flux2-{variant}-tiny-fp8_scaled.safetensors"
    save_file(comfy_tensors(transformer_state(folder), "fp8_scaled"), str(denoiser))
    parts = comfy_parts(folder, tmp_path / "parts")
    report = generate_from_files(comfy, f"tiny/flux2-{variant}", denoiser, parts,
                                 {"negative_prompt": "", "guidance": guidance}, tmp_path)
    assert pipeline in report and "fp8" in report, report
    shutil.rmtree(folder)

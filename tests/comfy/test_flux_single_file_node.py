"""Load diffusion model file (diffusers) with FLUX.1 files in BFL's key layout, in a real ComfyUI:
the bf16 and the GGUF Q8_0 file are listed from an extra diffusion_models path, load into a Flux
folder without transformer weights (the VAE from its own file) and run through Generate image; the
files are unchanged. The fp8_scaled file is refused today (see test_flux_single_file.py).

diffusers' Flux converter only splits FLUX.1's width: `flux_tiny_width` (tests/fixtures/flux_files.py)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest
from comfyhost import harness
from fixtures import flux_files

pytest_plugins = ["comfyhost.fixtures"]
_bfl_flux, _flux_tiny_width = flux_files.bfl_flux, flux_files.flux_tiny_width
pytestmark = pytest.mark.usefixtures("flux_tiny_width")
LOADER = "DiffusersOffloadLoadDiffusionModelFile"
FILES = {
    "bf16": "flux-tiny-bf16.safetensors",
    "Q8_0": "flux-tiny-Q8_0.gguf",
    "fp8_scaled": "flux-tiny-fp8_scaled.safetensors",
}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def placed(comfy: harness.ComfyHost, bfl_flux, tiny_flux_dir: Path, tmp_path_factory) -> dict:
    """The Flux files in an extra diffusion_models path, the VAE in ComfyUI's vae folder, the tiny
    Flux folder less its transformer weights in its diffusers folder."""
    fp = comfy.folder_paths
    extra = tmp_path_factory.mktemp("extra-flux-models")
    for fmt, name in FILES.items():
        shutil.copyfile(bfl_flux(fmt), extra / name)
    fp.add_model_folder_path("diffusion_models", str(extra))
    vae = Path(fp.get_folder_paths("vae")[0]) / "flux-vae-tiny.safetensors"
    shutil.copyfile(next((tiny_flux_dir / "vae").glob("*.safetensors")), vae)
    target = Path(fp.get_folder_paths("diffusers")[0]) / "tiny" / "flux-no-transformer"
    if not target.is_dir():
        shutil.copytree(
            tiny_flux_dir,
            target,
            ignore=lambda d, names: [
                n for n in names if Path(d).name == "transformer" and n != "config.json"
            ],
        )
    return {"config": "tiny/flux-no-transformer", "extra": extra, "vae": vae.name}


def prompt(placed: dict, denoiser: str) -> dict[str, Any]:
    load = {
        "config": placed["config"],
        "denoiser": denoiser,
        "text_encoder": "none",
        "vae": placed["vae"],
        "dtype": "bf16",
    }
    gen = {
        "pipe": ["1", 0],
        "prompt": "a cat",
        "negative_prompt": "",
        "seed": 0,
        "steps": 1,
        "guidance": 1.0,
        "width": 16,
        "height": 16,
        "batch_size": 1,
    }
    return {
        "1": {"class_type": LOADER, "inputs": load},
        "2": {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": ["1", 0]}},
        "3": {"class_type": "DiffusersOffloadGenerateImage", "inputs": gen},
        "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 1]}},
    }


def _run_file(comfy: harness.ComfyHost, placed: dict, fmt: str) -> None:
    path = placed["extra"] / FILES[fmt]
    before = _digest(path)
    _type, opts = comfy.nodes.NODE_CLASS_MAPPINGS[LOADER].INPUT_TYPES()["required"]["denoiser"]
    assert path.name in opts["options"]
    try:
        comfy.run_prompt(prompt(placed, path.name)).raise_for_error()
    finally:
        assert _digest(path) == before


@pytest.mark.parametrize("fmt", ["bf16", "Q8_0"])
def test_a_flux_file_loads_and_generates(comfy: harness.ComfyHost, placed: dict, fmt: str) -> None:
    _run_file(comfy, placed, fmt)


def test_a_flux_fp8_scaled_file_loads_and_generates(comfy: harness.ComfyHost, placed: dict) -> None:
    _run_file(comfy, placed, "fp8_scaled")

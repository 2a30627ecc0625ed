"""A model's ComfyUI files run through the pack's nodes in the session's ComfyUI: the denoiser from an
extra ``diffusion_models`` path (as ``extra_model_paths.yaml`` adds one), the text-encoder and VAE
files in ComfyUI's own folders, loaded by Load diffusion model file into a diffusers folder of
``models/diffusers`` and run through Generate image."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from comfyhost import harness

LOADER = "DiffusersOffloadLoadDiffusionModelFile"
FOLDERS = {"text_encoder": "text_encoders", "vae": "vae"}


def generate_from_files(comfy: harness.ComfyHost, config: str, denoiser: Path, parts: dict[str, Path], gen: dict,
                        tmp: Path) -> str:
    """Generate one 32 × 32 image from ``denoiser`` (listed from an extra path under ``tmp``) and
    ``parts`` (loader input -> file, copied into ComfyUI's folder of that input) with the diffusers
    folder ``config``; checks the image and that no file changed; removes the copies; the report."""
    fp = comfy.folder_paths
    extra = tmp / "extra-diffusion-models"
    extra.mkdir()
    shutil.copyfile(denoiser, extra / denoiser.name)
    fp.add_model_folder_path("diffusion_models", str(extra))
    _type, opts = comfy.nodes.NODE_CLASS_MAPPINGS[LOADER].INPUT_TYPES()["required"]["denoiser"]
    assert denoiser.name in opts["options"]  # (listed from the extra path)
    placed = {name: Path(fp.get_folder_paths(FOLDERS[name])[0]) / path.name for name, path in parts.items()}
    for name, path in placed.items():
        shutil.copyfile(parts[name], path)
    files = [extra / denoiser.name, *placed.values()]
    before = [hashlib.sha256(p.read_bytes()).hexdigest() for p in files]
    load = {"config": config, "denoiser": denoiser.name, "text_encoder": "none", "vae": "none", "dtype": "bf16"}
    load |= {name: path.name for name, path in placed.items()}
    result = comfy.run_prompt({
        "1": {"class_type": LOADER, "inputs": load},
        "2": {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": ["1", 0]}},
        "3": {"class_type": "DiffusersOffloadGenerateImage", "inputs": {
            "pipe": ["1", 0], "prompt": "a red fox", "seed": 0, "steps": 2, "width": 32, "height": 32,
            "batch_size": 1, **gen}},
        "4": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
        "5": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}},
    })
    result.raise_for_error()
    assert len(result.outputs["5"]["images"]) == 1
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in files] == before
    for path in placed.values():  # (ComfyUI's folders are the session's: leave no model behind)
        path.unlink()
    return "".join(result.outputs["4"]["text"])

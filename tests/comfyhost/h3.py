"""The MiniMax-H3 graph the ComfyUI tests build on the tiny H3: Offload settings -> Load modular
pipeline -> Generate (H3) -> one capture node per output slot. Each test module registers its own
capture class (see `capture`), whose name it passes here."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

LOAD, GEN = "1", "2"
SETTINGS = {  # every role gets a transport on the tiny model
    "mode": "auto", "use_stream": True, "record_stream": False, "pin_memory": True, "pin_reserve_gb": 4.0,
    "on_demand_threshold_gb": 0.0, "resident_floor_mb": 0.0, "always": "", "never": "", "preload": "auto",
    "prefetch_window": 1, "device": "", "measures_path": "",
}


def linked(comfy: Any, tiny_h3_dir: Path, capture: str, cls: type) -> Iterator[str]:
    """For a module-scoped ``model`` fixture: the tiny H3 linked into models/diffusers (its name
    yielded) with the module's capture class registered as ``capture`` meanwhile."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(comfy.nodes.NODE_CLASS_MAPPINGS, capture, cls)
        yield ex.link_model(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]), tiny_h3_dir)


def graph(model: str, capture: str, workflow: str = "t2va", outputs: tuple[int, ...] = (0, 1, 2, 3),
          **inputs: Any) -> dict:
    """Settings -> Load modular pipeline -> Generate (H3) -> one ``capture`` per output slot."""
    values = {"prompt": "a robot dancing", "seed": 0, "steps": 3, "width": 32, "height": 32, "frames": 124,
              "duration": 0.0, "generate_audio": True, "vae_scale_factor": 0, **inputs}
    prompt = {
        "s": {"class_type": "DiffusersOffloadSettings", "inputs": SETTINGS},
        LOAD: {"class_type": "DiffusersOffloadLoadModularPipeline",
               "inputs": {"model": model, "workflow": workflow, "dtype": "fp32", "offload": ["s", 0]}},
        GEN: {"class_type": "DiffusersOffloadGenerateH3", "inputs": {"pipe": [LOAD, 0], **values}},
    }
    for slot in outputs:
        prompt[f"c{slot}"] = {"class_type": capture, "inputs": {"value": [GEN, slot], "slot": slot}}
    return prompt


def capture_pipe(prompt: dict, capture: str) -> dict:
    """Also capture the loader's pipe, as slot 9."""
    prompt["c9"] = {"class_type": capture, "inputs": {"value": [LOAD, 0], "slot": 9}}
    return prompt


def outputs(seen: list[tuple[int, Any]]) -> dict[int, Any]:
    return dict(seen)


def assert_frames(images: Any, count: int) -> None:
    assert isinstance(images, torch.Tensor) and images.shape == (count, 32, 32, 3)
    assert images.dtype == torch.float32 and images.device.type == "cpu"
    assert 0.0 <= images.min() <= images.max() <= 1.0

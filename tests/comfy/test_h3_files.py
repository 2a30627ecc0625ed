"""MiniMax-H3's component files through ComfyUI: Load modular pipeline's ``transformer_file``,
``text_encoder_file`` and ``vae_file``, each picked from ComfyUI's model folders beside the tiny H3
folder; each run generates as the folder's component does, and no file is written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyhost import h3, harness
from comfyhost.capture import capture_class
from comfyhost.h3 import LOAD, assert_frames, capture_pipe, outputs

pytest_plugins = ["comfyhost.fixtures"]

CAPTURE = "DiffusersOffloadTest_CaptureH3Files"
Capture = capture_class()


@pytest.fixture(scope="module")
def model(comfy: harness.ComfyHost, tiny_h3_dir: Path) -> Iterator[str]:
    yield from h3.linked(comfy, tiny_h3_dir, CAPTURE, Capture)


@pytest.fixture
def captured(model: str) -> list:
    Capture.seen.clear()
    return Capture.seen


def generate(comfy: harness.ComfyHost, model: str, captured: list, **load: Any) -> dict[int, Any]:
    """One 2-step run with Load modular pipeline's inputs updated by ``load``: the frames (slot 1)
    and the loaded pipe (slot 9)."""
    captured.clear()
    prompt = capture_pipe(h3.graph(model, CAPTURE, outputs=(1,), steps=2), CAPTURE)
    prompt[LOAD]["inputs"] |= load
    comfy.run_prompt(prompt).raise_for_error()
    return outputs(captured)


def test_a_w4a8_transformer_file_runs_in_the_modular_pipeline(
    comfy: harness.ComfyHost, model: str, captured: list, tiny_h3_dir: Path
) -> None:
    """MiniMax-H3 as it circulates: a ComfyUI W4A8 transformer file in the Comfy-Org layout, picked
    in Load modular pipeline beside the folder, loads as W4A8 layers and generates; the file unchanged."""
    from diffusers import MiniMaxH3Transformer3DModel
    from fixtures.h3_files import comfy_h3_state_dict, w4a8_layers, write
    from fixtures.quantized import digest

    original = MiniMaxH3Transformer3DModel.from_pretrained(str(tiny_h3_dir / "transformer"), torch_dtype=torch.bfloat16)
    name = "h3-tiny-w4a8.safetensors"
    path = write(w4a8_layers(comfy_h3_state_dict(original.state_dict(), dict(original.config))),
                 Path(comfy.folder_paths.get_folder_paths("diffusion_models")[0]) / name)
    before = digest(path)

    out = generate(comfy, model, captured, transformer_file=name, dtype="bf16")

    assert_frames(out[1], 124)
    # by name: ComfyUI imports the pack under its own module path
    layers = [n for n, m in out[9].pipe.transformer.named_modules() if type(m).__name__ == "W4A8Linear"]
    assert "context_embedder" in layers and any(n.startswith("transformer_blocks.") for n in layers)
    assert digest(path) == before


def test_a_comfyui_text_encoder_file_conditions_the_modular_pipeline(
    comfy: harness.ComfyHost, model: str, captured: list, tiny_h3_dir: Path
) -> None:
    """MiniMax-H3's conditioner as ComfyUI's H3 text-encoder files hold it (its layout, 50 layers, no
    head), picked from models/text_encoders: the run gives the frames the folder's encoder gives."""
    from fixtures.h3_files import comfy_conditioner_state_dict, write
    from fixtures.quantized import digest
    from transformers import Qwen3VLForConditionalGeneration

    whole = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_h3_dir / "text_encoder"), dtype=torch.float32)
    name = "h3-tiny-conditioner.safetensors"
    path = Path(comfy.folder_paths.get_folder_paths("text_encoders")[0]) / name
    write(comfy_conditioner_state_dict(whole.state_dict(), 50), path)
    before = digest(path)
    reference = generate(comfy, model, captured)[1]

    out = generate(comfy, model, captured, text_encoder_file=name)

    torch.testing.assert_close(out[1], reference, rtol=0, atol=0)
    layers = out[9].pipe.text_encoder.model.language_model.layers
    assert len(layers) == 50 and type(out[9].pipe.text_encoder.lm_head).__name__ == "NoHead"
    assert digest(path) == before


def test_a_comfyui_vae_file_decodes_for_the_modular_pipeline(
    comfy: harness.ComfyHost, model: str, captured: list, tiny_h3_dir: Path
) -> None:
    """MiniMax-H3's video VAE as ComfyUI's H3 VAE file holds it, picked from models/vae: the run gives
    the frames the folder's VAE gives, and the file is left as it was; a file whose output bias is
    moved moves the frames (the file is what decodes)."""
    from diffusers import AutoencoderKLMiniMaxH3
    from fixtures.h3_files import comfy_h3_vae_state_dict, write
    from fixtures.quantized import digest

    vae = AutoencoderKLMiniMaxH3.from_pretrained(str(tiny_h3_dir / "vae"))
    name = "h3-tiny-vae.safetensors"
    path = Path(comfy.folder_paths.get_folder_paths("vae")[0]) / name
    write(comfy_h3_vae_state_dict(vae), path)
    before = digest(path)
    reference = generate(comfy, model, captured)[1]

    out = generate(comfy, model, captured, vae_file=name)

    torch.testing.assert_close(out[1], reference, rtol=0, atol=0)
    assert digest(path) == before
    moved = comfy_h3_vae_state_dict(vae)
    moved["decoder.proj_out.bias"] = moved["decoder.proj_out.bias"] + 0.5
    write(moved, path.with_name("h3-tiny-vae-moved.safetensors"))
    assert not torch.equal(generate(comfy, model, captured, vae_file="h3-tiny-vae-moved.safetensors")[1], reference)

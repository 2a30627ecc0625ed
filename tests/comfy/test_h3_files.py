"""MiniMax-H3's component files through ComfyUI: Load modular pipeline's ``transformer_file``,
``text_encoder_file`` and ``vae_file``, each picked from ComfyUI's model folders beside the tiny H3
folder; each run generates as the folder's component does, and no file is written."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyhost import h3, harness
from comfyhost.capture import capture_class
from comfyhost.h3 import LOAD, assert_frames, capture_pipe
from PIL import Image

pytest_plugins = ["comfyhost.fixtures"]

CAPTURE = "DiffusersOffloadTest_CaptureH3Files"
Capture = capture_class()


@pytest.fixture(scope="module")
def model(comfy: harness.ComfyHost, tiny_h3_dir: Path) -> Iterator[str]:
    yield from h3.linked(comfy, tiny_h3_dir, CAPTURE, Capture)


def options(comfy: harness.ComfyHost, name: str) -> list[str]:
    _type, opts = comfy.nodes.NODE_CLASS_MAPPINGS["DiffusersOffloadLoadModularPipeline"].INPUT_TYPES()["required"][name]
    return opts["options"]


@pytest.fixture
def captured(model: str) -> list:
    Capture.seen.clear()
    return Capture.seen


def generate(comfy: harness.ComfyHost, model: str, captured: list, outputs: tuple[int, ...] = (1,),
             **load: Any) -> dict[int, Any]:
    """One 2-step run with Load modular pipeline's inputs updated by ``load``: the frames (slot 1),
    the audio (slot 2) where asked, and the loaded pipe (slot 9)."""
    captured.clear()
    prompt = capture_pipe(h3.graph(model, CAPTURE, outputs=outputs, steps=2), CAPTURE)
    prompt[LOAD]["inputs"] |= load
    comfy.run_prompt(prompt).raise_for_error()
    return dict(captured)


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


@pytest.fixture
def carried_h3(comfy: harness.ComfyHost, tiny_h3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tiny H3 as the pack's carried MiniMax-H3 configs are (configs only, no tokenizer) in their
    place, so that the loader lists it as ``pack: <name>``, and the loader's ComfyUI package folder
    pointed at one holding the tiny tokenizer where ComfyUI ships its Qwen tokenizer."""
    from fixtures.h3_files import carried_like_h3

    folder, package = carried_like_h3(tiny_h3_dir, tmp_path / "carried" / "tiny-h3-carried")
    monkeypatch.setattr(comfy.pack_submodule("offload_core.formats.carried"), "ROOT", folder.parent)
    monkeypatch.setattr(comfy.pack_submodule("nodes.loaders"), "comfy_package", lambda: package)
    return "pack: " + folder.name


def comfy_h3_files(comfy: harness.ComfyHost, tiny_h3_dir: Path) -> dict[str, str]:
    """The tiny H3's four models as ComfyUI's H3 files hold them, in ComfyUI's folders: the loader's
    file inputs, by name."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel
    from fixtures import h3_files as f
    from transformers import Qwen3VLForConditionalGeneration

    transformer = MiniMaxH3Transformer3DModel.from_pretrained(str(tiny_h3_dir / "transformer"))
    text = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_h3_dir / "text_encoder"), dtype=torch.float32)
    states = {
        ("diffusion_models", "transformer_file"): f.comfy_h3_state_dict(transformer.state_dict(), dict(transformer.config)),
        ("text_encoders", "text_encoder_file"): f.comfy_conditioner_state_dict(text.state_dict(), 50),
        ("vae", "vae_file"): f.comfy_h3_vae_state_dict(AutoencoderKLMiniMaxH3.from_pretrained(str(tiny_h3_dir / "vae"))),
        ("vae", "audio_vae_file"): f.comfy_h3_audio_vae_state_dict(
            AutoencoderKLMiniMaxH3Audio.from_pretrained(str(tiny_h3_dir / "audio_vae"))),
    }
    names = {}
    for (folder, field), state in states.items():
        names[field] = f"h3-tiny-{field}.safetensors"
        f.write(state, Path(comfy.folder_paths.get_folder_paths(folder)[0]) / names[field])
    return names


def test_the_packs_h3_configs_run_comfyuis_files_as_the_folder_does(
    comfy: harness.ComfyHost, model: str, captured: list, tiny_h3_dir: Path, carried_h3: str
) -> None:
    """Load modular pipeline with the configs the pack carries for MiniMax-H3 (no diffusers folder)
    and ComfyUI's four H3 files: the tokenizer is ComfyUI's own folder's, the run gives the frames
    and the audio the diffusers folder gives."""
    from fixtures.quantized import digest

    files = comfy_h3_files(comfy, tiny_h3_dir)
    assert options(comfy, "model")[0] == carried_h3  # the pack's configs first, then models/diffusers
    reference = generate(comfy, model, captured, outputs=(1, 2))
    paths = [Path(comfy.folder_paths.get_full_path(folder, name))
             for folder, name in zip(("diffusion_models", "text_encoders", "vae", "vae"), files.values(), strict=True)]
    before = [digest(path) for path in paths]

    out = generate(comfy, carried_h3, captured, outputs=(1, 2), **files)

    torch.testing.assert_close(out[1], reference[1], rtol=0, atol=0)
    torch.testing.assert_close(out[2]["waveform"], reference[2]["waveform"], rtol=0, atol=0)
    pipe = out[9].pipe
    assert type(pipe.tokenizer).__name__.startswith("Qwen2Tokenizer") and pipe.processor.tokenizer is pipe.tokenizer
    assert [digest(path) for path in paths] == before


def test_the_packs_h3_configs_without_the_files_name_the_inputs_to_pick(
    comfy: harness.ComfyHost, captured: list, tiny_h3_dir: Path, carried_h3: str
) -> None:
    files = comfy_h3_files(comfy, tiny_h3_dir)
    prompt = capture_pipe(h3.graph(carried_h3, CAPTURE, outputs=(1,), steps=2), CAPTURE)
    prompt[LOAD]["inputs"]["text_encoder_file"] = files["text_encoder_file"]
    result = comfy.run_prompt(prompt)
    assert not result.success
    assert re.search(r"tiny-h3-carried holds configs only \(no weights\): pick transformer_file, vae_file, "
                     r"audio_vae_file", result.error["exception_message"]), result.error["exception_message"]
    prompt[LOAD]["inputs"] |= files
    comfy.run_prompt(prompt).raise_for_error()  # the next prompt runs


def test_comfyuis_qwen_tokenizer_folder_reads_prompts_as_comfyuis_h3_tokenizer(comfy: harness.ComfyHost) -> None:
    """The carried MiniMax-H3 configs' tokenizer, read from the running ComfyUI's own folder by the
    pack, gives the ids ComfyUI's H3 tokenizer gives (trees before H3: its Qwen-Image tokenizer,
    which reads the same folder with the same class), vision tokens included."""
    carried = comfy.pack_submodule("offload_core.formats.carried")
    parts = comfy.pack_submodule("offload_core.models.minimax_h3.carried_parts")
    package = comfy.pack_submodule("nodes.model_files").comfy_package()
    ours = parts.tokenizer_and_processor(carried.by_name("MiniMax-H3"), package)
    try:
        from comfy.text_encoders.minimax import MiniMaxH3Tokenizer

        theirs = MiniMaxH3Tokenizer()._text_ids
    except ImportError:
        from comfy.text_encoders.qwen_image import Qwen25_7BVLITokenizer

        hf = Qwen25_7BVLITokenizer().tokenizer
        theirs = lambda text: hf(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for text in ("a robot dancing in the rain", "Ünïcødé — 東京の夜 (sitting:1.2)",
                 "<|vision_start|><|image_pad|><|vision_end|> then a cat"):
        assert ours["tokenizer"](text, add_special_tokens=False)["input_ids"] == theirs(text)
    assert len(ours["tokenizer"]) == 151669
    grid = ours["processor"].image_processor(images=[Image.new("RGB", (1344, 768))], return_tensors="pt")
    assert grid["image_grid_thw"].tolist() == [[1, 48, 84]]  # Qwen3-VL's 16 px patches at H3's canvas

"""Load diffusion model file (diffusers) in a real ComfyUI: it lists denoiser files from ComfyUI's
folders (an extra path too, as extra_model_paths.yaml adds), loads the tiny Wan fp8_scaled file
into a configs-only folder with text-encoder and VAE files (ComfyUI int8_tensorwise, convrot too, and W4A8 files, run
through Generate; Wan 2.2 A14B's two experts run in test_workflows' template), and a bad file comes back as a prompt error naming it, the file unchanged, the
next prompt running."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyhost import harness
from fixtures import comfy_files, gguf_files
from fixtures.tiny_tok import tiny_t5_spiece

pytest_plugins = ["comfyhost.fixtures"]
_comfy_wan, _configs_only, _component_files, _wan_gguf = (
    comfy_files.comfy_wan,
    comfy_files.wan_configs_only,
    comfy_files.wan_component_files,
    gguf_files.wan_gguf_fixture,
)
_comfy_int8_wan = comfy_files.comfy_int8_wan
LOADER = "DiffusersOffloadLoadDiffusionModelFile"


@pytest.fixture(scope="module")
def placed(
    comfy: harness.ComfyHost, comfy_wan, wan_configs_only, wan_component_files, tmp_path_factory
) -> dict:
    """The files in ComfyUI's folders: the denoiser in an extra diffusion_models path."""
    fp = comfy.folder_paths
    extra = tmp_path_factory.mktemp("extra-diffusion-models")
    shutil.copyfile(comfy_wan("fp8_scaled"), extra / "wan-tiny-fp8_scaled.safetensors")
    fp.add_model_folder_path("diffusion_models", str(extra))
    shutil.copyfile(
        wan_component_files["text_encoder"],
        Path(fp.get_folder_paths("text_encoders")[0]) / "umt5-tiny.safetensors",
    )
    shutil.copyfile(
        wan_component_files["vae"], Path(fp.get_folder_paths("vae")[0]) / "wan-vae-tiny.safetensors"
    )
    target = Path(fp.get_folder_paths("diffusers")[0]) / "tiny" / "wan-configs"
    if not target.is_dir():
        shutil.copytree(wan_configs_only, target)
    return {
        "config": "tiny/wan-configs",
        "denoiser": "wan-tiny-fp8_scaled.safetensors",
        "extra": extra,
        "text_encoder": "umt5-tiny.safetensors",
        "vae": "wan-vae-tiny.safetensors",
    }


def prompt(placed: dict, **change: Any) -> dict[str, Any]:
    inputs = (
        {k: placed[k] for k in ("config", "denoiser", "text_encoder", "vae")} | {"dtype": "bf16"} | change
    )
    return {
        "1": {"class_type": LOADER, "inputs": inputs},
        "2": {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": ["1", 0]}},
    }


def options(comfy: harness.ComfyHost, name: str) -> list[str]:
    _type, opts = comfy.nodes.NODE_CLASS_MAPPINGS[LOADER].INPUT_TYPES()["required"][name]
    return opts["options"]


def test_lists_files_from_comfy_folders_and_loads_fp8_scaled(comfy: harness.ComfyHost, placed: dict) -> None:
    assert placed["denoiser"] in options(comfy, "denoiser")
    assert placed["text_encoder"] in options(comfy, "text_encoder") and "none" in options(comfy, "vae")
    comfy.run_prompt(prompt(placed)).raise_for_error()


def test_fp8_matmul_on_an_fp8_scaled_file_keeps_its_weights_and_scales(comfy: harness.ComfyHost,
                                                                       placed: dict) -> None:
    """The file's fp8 weights and scales stay as loaded (no second cast, no scale dropped); its
    table computes through fp8 matmuls."""
    comfy.run_prompt(prompt(placed, fp8_matmul=True)).raise_for_error()
    ours = comfy.pack_submodule("nodes.host").DiffusersPatcher
    transformer = next(lm.model for lm in comfy.model_management.current_loaded_models  # (newest first)
                       if isinstance(lm.model, ours)).pipe.transformer
    table = comfy.pack_submodule("offload_core.formats.fp8").table_of(transformer)
    assert table.matmul and table.storage == torch.float8_e4m3fn and len(table.scales) == len(table.weights) > 0


def test_a_bad_file_is_a_prompt_error_naming_it_and_the_next_prompt_runs(
    comfy: harness.ComfyHost, placed: dict
) -> None:
    bad = placed["extra"] / "wan-truncated.safetensors"
    bad.write_bytes((placed["extra"] / placed["denoiser"]).read_bytes()[:5000])
    before = hashlib.sha256(bad.read_bytes()).hexdigest()
    result = comfy.run_prompt(prompt(placed, denoiser=bad.name))
    assert not result.success and "wan-truncated.safetensors" in result.error["exception_message"]
    assert hashlib.sha256(bad.read_bytes()).hexdigest() == before
    te = comfy.run_prompt(prompt(placed, denoiser=placed["denoiser"], text_encoder="none"))
    assert not te.success and "pick a text-encoder file" in te.error["exception_message"]
    comfy.run_prompt(prompt(placed)).raise_for_error()


def test_a_second_denoiser_for_a_folder_without_one_is_a_prompt_error_naming_it(comfy: harness.ComfyHost,
                                                                               placed: dict) -> None:
    """``denoiser_2`` (Wan 2.2 A14B's low-noise expert) lists the denoiser files; on a Wan 2.1 folder,
    which has one denoiser, it is refused by name and the next prompt runs."""
    _type, opts = comfy.nodes.NODE_CLASS_MAPPINGS[LOADER].INPUT_TYPES()["optional"]["denoiser_2"]
    assert opts["default"] == "none" and placed["denoiser"] in opts["options"]
    result = comfy.run_prompt(prompt(placed, denoiser_2=placed["denoiser"]))
    assert not result.success
    assert "has no transformer_2: leave its second denoiser file" in result.error["exception_message"]
    comfy.run_prompt(prompt(placed)).raise_for_error()


def test_an_image_encoder_file_lists_clip_vision_and_a_t2v_folder_refuses_it(comfy: harness.ComfyHost,
                                                                            placed: dict, wan_component_files) -> None:
    """``image_encoder`` (Wan 2.1 I2V's CLIP vision file) lists models/clip_vision; a text-to-video
    folder, which has no image encoder, refuses one by name and the next prompt runs."""
    folder = Path(comfy.folder_paths.get_folder_paths("clip_vision")[0])
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(wan_component_files["text_encoder"], folder / "clip_vision_tiny.safetensors")
    _type, opts = comfy.nodes.NODE_CLASS_MAPPINGS[LOADER].INPUT_TYPES()["optional"]["image_encoder"]
    assert opts["default"] == "none" and "clip_vision_tiny.safetensors" in opts["options"]
    result = comfy.run_prompt(prompt(placed, image_encoder="clip_vision_tiny.safetensors"))
    assert not result.success and "has no image_encoder: leave its image-encoder file" in result.error["exception_message"]
    comfy.run_prompt(prompt(placed)).raise_for_error()


def test_a_gguf_file_in_diffusion_models_is_listed_and_loads_without_a_gguf_pack(
    comfy: harness.ComfyHost, placed: dict, wan_gguf
) -> None:
    """Plain ComfyUI lists no .gguf file (only ComfyUI-GGUF registers them): the loader lists and
    resolves the ones in diffusion_models itself, and leaves ComfyUI's folder table as it was."""
    table = comfy.folder_paths.folder_names_and_paths
    assert "unet_gguf" not in table
    before = {k: (list(v[0]), set(v[1])) for k, v in table.items()}
    shutil.copyfile(wan_gguf("Q8_0").file, placed["extra"] / "wan-tiny-Q8_0.gguf")
    assert "wan-tiny-Q8_0.gguf" in options(comfy, "denoiser")
    comfy.run_prompt(prompt(placed, denoiser="wan-tiny-Q8_0.gguf")).raise_for_error()
    assert {k: (list(v[0]), set(v[1])) for k, v in table.items()} == before


@pytest.mark.parametrize("convrot", [0, 4], ids=["plain", "convrot"])
def test_an_int8_tensorwise_file_loads_and_generates(
    comfy: harness.ComfyHost, placed: dict, comfy_int8_wan, convrot: int
) -> None:
    """A ComfyUI int8_tensorwise file (per-row scales; convrot: comfy-kitchen's rotated layers, as
    Comfy-Org's practical H3 files hold) through the loader, the report and Generate."""
    generates(comfy, placed, f"wan-tiny-int8-row-{convrot}.safetensors", comfy_int8_wan(per_row=True, convrot=convrot))


def test_a_w4a8_file_loads_and_generates(
    comfy: harness.ComfyHost, placed: dict, tiny_wan_dir: Path, tmp_path: Path
) -> None:
    """A ComfyUI W4A8 file (comfy-kitchen's asym_w4a8_int8) through the loader, the report and Generate."""
    generates(comfy, placed, "wan-tiny-w4a8.safetensors",
              comfy_files.write_comfy_w4a8_wan(tiny_wan_dir, tmp_path / "w4a8.safetensors"))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_a_block_scaled_file_loads_and_generates(
    comfy: harness.ComfyHost, placed: dict, tiny_wan_dir: Path, tmp_path: Path, fmt: str
) -> None:
    """A ComfyUI NVFP4 or MXFP8 file (comfy-kitchen's layouts; the tiny Wan's widths padded) through
    the loader, the report and Generate."""
    from fixtures.mxfp8_files import write_comfy_mxfp8_wan
    from fixtures.nvfp4_files import write_comfy_nvfp4_wan

    write = {"nvfp4": write_comfy_nvfp4_wan, "mxfp8": write_comfy_mxfp8_wan}[fmt]
    generates(comfy, placed, f"wan-tiny-{fmt}.safetensors", write(tiny_wan_dir, tmp_path / f"{fmt}.safetensors"))


def test_a_gguf_text_encoder_in_text_encoders_is_listed_and_generates(comfy: harness.ComfyHost, placed: dict,
                                                                     wan_component_files) -> None:
    """city96's umt5-xxl-encoder GGUFs (ComfyUI-GGUF's CLIPLoaderGGUF reads them): picked from
    models/text_encoders, where plain ComfyUI lists no .gguf file."""
    from fixtures.gguf_text_encoders import t5_state, write_t5_gguf

    folder = Path(comfy.folder_paths.get_folder_paths("text_encoders")[0])
    te = write_t5_gguf(t5_state(wan_component_files["text_encoder"]), folder / "umt5-tiny-encoder-Q8_0.gguf")
    assert te.name in options(comfy, "text_encoder")
    generates(comfy, placed, placed["denoiser"], None, text_encoder=te.name)


def test_auto_takes_the_configs_the_pack_carries(comfy: harness.ComfyHost, placed: dict, tiny_wan_dir: Path,
                                                 wan_component_files, tmp_path: Path, monkeypatch) -> None:
    """``config`` offers 'auto' first, then each carried folder, then models/diffusers; the tiny file
    fits none of the released Wan shapes: a prompt error naming it. With a tiny carried root in the
    pack's place, auto picks its folder, the tokenizer comes from the text-encoder file's
    sentencepiece model, and Generate runs."""
    carried = comfy.pack_submodule("offload_core.formats.carried")
    opts = options(comfy, "config")
    assert opts[0] == "auto: the configs the pack carries" and placed["config"] in opts
    assert opts[1:1 + len(carried.carried())] == ["pack: " + p.name for p in carried.carried()]
    result = comfy.run_prompt(prompt(placed, config=opts[0]))
    message = "" if result.success else result.error["exception_message"]
    assert placed["denoiser"] in message and "none of the configs the pack carries" in message
    wan = comfy_files.carried_like_copy(tiny_wan_dir, tmp_path / "carried" / "tiny-wan")
    monkeypatch.setattr(carried, "ROOT", wan.parent)
    te = comfy_files.write_fp8_text_encoder(
        wan_component_files["text_encoder"], Path(comfy.folder_paths.get_folder_paths("text_encoders")[0])
        / "umt5-tiny-fp8_scaled-spiece.safetensors", scaled=True, spiece=tiny_t5_spiece())
    assert options(comfy, "config")[1] == "pack: tiny-wan"
    generates(comfy, placed, placed["denoiser"], None, config=opts[0], text_encoder=te.name)
    # a workflow saved with the option's earlier label still runs; a config nobody lists is refused by name
    generates(comfy, placed, placed["denoiser"], None, config="auto: the pack's configs (Wan, FLUX.1)", text_encoder=te.name)
    with pytest.raises(harness.PromptValidationError, match="config 'tiny-wan-moved' is not auto, a config folder"):
        comfy.run_prompt(prompt(placed, config="tiny-wan-moved"))


def test_flux_configs_take_comfyuis_own_tokenizers(comfy: harness.ComfyHost) -> None:
    """The carried FLUX.1 folders hold no tokenizer: CLIP-L's and T5's load from the running
    ComfyUI's own folders (where the node points) and tokenize a prompt as ComfyUI's Flux tokenizer."""
    import comfy.text_encoders.flux as comfy_flux

    carried = comfy.pack_submodule("offload_core.formats.carried")
    for folder in (carried.by_name("FLUX.1-dev"), carried.by_name("FLUX.1-schnell")):
        index = json.loads((folder / "model_index.json").read_text())
        ours = carried.missing_tokenizers(folder, index, {}, comfy.pack_submodule("nodes.single_file").comfy_package())
        assert ours["tokenizer"].model_max_length == 77 and ours["tokenizer_2"].model_max_length == 512
        prompt = "A red fox, jumping over a frozen river at dawn - photo: 35mm, f/1.8!"  # (no ComfyUI weights)
        theirs = comfy_flux.FluxTokenizer().tokenize_with_weights(prompt)
        for name, key in (("tokenizer", "l"), ("tokenizer_2", "t5xxl")):
            ids = ours[name](prompt).input_ids
            assert [t[0] for t in theirs[key][0]][:len(ids)] == ids, name


def generates(comfy: harness.ComfyHost, placed: dict, name: str, source: Path | None, **change: Any) -> None:
    """``source`` copied into the extra diffusion_models folder as ``name`` (None: already there),
    listed, loaded with ``change`` and run through Generate (one step); the file unchanged."""
    if source is not None:
        shutil.copyfile(source, placed["extra"] / name)
    before = hashlib.sha256((placed["extra"] / name).read_bytes()).hexdigest()
    assert name in options(comfy, "denoiser")
    gen = {
        "pipe": ["1", 0],
        "prompt": "a cat",
        "negative_prompt": "",
        "seed": 0,
        "steps": 1,
        "guidance": 1.0,
        "width": 16,
        "height": 16,
        "frames": 5,
        "fps": 0.0,
    }
    run = prompt(placed, denoiser=name, **change) | {
        "3": {"class_type": "DiffusersOffloadGenerateVideo", "inputs": gen},
        "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 3]}},
    }
    comfy.run_prompt(run).raise_for_error()
    assert hashlib.sha256((placed["extra"] / name).read_bytes()).hexdigest() == before


def test_an_ltx2_checkpoint_from_checkpoints_runs_with_auto(comfy: harness.ComfyHost, tmp_path: Path,
                                                            monkeypatch) -> None:
    """ComfyUI's all-in-one LTX-2 checkpoint, listed from models/checkpoints, with its Gemma 3 file
    from models/text_encoders and ``auto`` (a tiny carried-like LTX-2 in the pack's configs' place):
    the connectors, VAEs and vocoder come from the checkpoint, the tokenizer from the Gemma file,
    and Generate video runs; neither file is written."""
    from diffusers import LTX2Pipeline
    from fixtures.ltx2_files import (
        build_tiny_ltx2_checkpointable,
        comfy_gemma3_text_state,
        write_ltx2_checkpoint,
    )
    from fixtures.tiny_tok import tiny_gemma_spiece
    from safetensors.torch import save_file

    folder = build_tiny_ltx2_checkpointable(tmp_path / "tiny-ltx2")
    pipe = LTX2Pipeline.from_pretrained(str(folder), dtype=torch.float32)
    fp = comfy.folder_paths
    checkpoint = write_ltx2_checkpoint(pipe, Path(fp.get_folder_paths("checkpoints")[0]) / "ltx-2-tiny-dev.safetensors")
    gemma = Path(fp.get_folder_paths("text_encoders")[0]) / "gemma_3_tiny_it.safetensors"
    save_file(comfy_gemma3_text_state(pipe.text_encoder.state_dict(), tiny_gemma_spiece()), str(gemma))
    carried = comfy_files.carried_like_copy(folder, tmp_path / "carried" / "tiny-ltx2")
    monkeypatch.setattr(comfy.pack_submodule("offload_core.formats.carried"), "ROOT", carried.parent)
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (checkpoint, gemma)}
    assert checkpoint.name in options(comfy, "denoiser")
    gen = {"pipe": ["1", 0], "prompt": "a cat", "negative_prompt": "", "seed": 0, "steps": 1, "guidance": 1.0,
           "width": 64, "height": 64, "frames": 9, "fps": 25.0}
    inputs = {"config": options(comfy, "config")[0], "denoiser": checkpoint.name, "text_encoder": gemma.name,
              "vae": "none", "dtype": "bf16"}
    run = {"1": {"class_type": LOADER, "inputs": inputs},
           "3": {"class_type": "DiffusersOffloadGenerateVideo", "inputs": gen},
           "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 3]}}}
    comfy.run_prompt(run).raise_for_error()
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (checkpoint, gemma)} == before

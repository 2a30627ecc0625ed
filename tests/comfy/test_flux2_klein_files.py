"""FLUX.2 [klein] from ComfyUI's files in a real ComfyUI: an fp8_scaled denoiser (BFL's names) from
an extra diffusion_models path, the Qwen3 text encoder from text_encoders and the VAE
(``flux2-vae``'s layout) from vae, loaded by Load diffusion model file into a FLUX.2 [klein]
diffusers folder and run through Generate image; the files are unchanged. The carried Klein
folders' tokenizer, read from the running ComfyUI's own folder, with Flux2KleinPipeline's chat call
gives the ids ComfyUI's Klein tokenizer gives. (Engine level, bit for bit, every placement:
tests/engine/test_flux2_klein_single_file.py.)"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from comfyhost import harness
from fixtures.comfy_files import comfy_tensors
from fixtures.flux2_klein_files import build_tiny_flux2_klein, comfy_flux2_klein_files, transformer_state
from safetensors.torch import save_file

pytest_plugins = ["comfyhost.fixtures"]
LOADER = "DiffusersOffloadLoadDiffusionModelFile"
FILE = "flux-2-klein-tiny-fp8_scaled.safetensors"


def test_comfyuis_klein_files_load_into_a_klein_folder_and_generate(comfy: harness.ComfyHost, tmp_path: Path) -> None:
    fp = comfy.folder_paths
    folder = build_tiny_flux2_klein(Path(fp.get_folder_paths("diffusers")[0]) / "tiny" / "flux2-klein")
    extra = tmp_path / "extra-diffusion-models"
    extra.mkdir()
    save_file(comfy_tensors(transformer_state(folder), "fp8_scaled"), str(extra / FILE))
    fp.add_model_folder_path("diffusion_models", str(extra))
    parts = comfy_flux2_klein_files(folder, tmp_path / "parts")
    placed = {"text_encoder": Path(fp.get_folder_paths("text_encoders")[0]) / "qwen_3_tiny.safetensors",
              "vae": Path(fp.get_folder_paths("vae")[0]) / "flux2-vae-tiny.safetensors"}
    for name, path in placed.items():
        shutil.copyfile(parts[name], path)
    files = [extra / FILE, *placed.values()]
    before = [hashlib.sha256(p.read_bytes()).hexdigest() for p in files]
    load = {"config": "tiny/flux2-klein", "denoiser": FILE, "text_encoder": placed["text_encoder"].name,
            "vae": placed["vae"].name, "dtype": "bf16"}
    gen = {"pipe": ["1", 0], "prompt": "a red fox", "negative_prompt": "", "seed": 0, "steps": 2,
           "guidance": 1.0, "width": 32, "height": 32, "batch_size": 1}
    result = comfy.run_prompt({
        "1": {"class_type": LOADER, "inputs": load},
        "2": {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": ["1", 0]}},
        "3": {"class_type": "DiffusersOffloadGenerateImage", "inputs": gen},
        "4": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
        "5": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}},
    })
    result.raise_for_error()
    report = "".join(result.outputs["4"]["text"])
    assert "Flux2KleinPipeline" in report and "fp8" in report, report
    assert len(result.outputs["5"]["images"]) == 1
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in files] == before
    for path in (folder, *placed.values()):  # (the model folders are the session's: leave no model behind)
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def test_the_carried_klein_tokenizer_reads_prompts_as_comfyuis_klein_tokenizer(comfy: harness.ComfyHost) -> None:
    """Flux2KleinPipeline's reading of a prompt (the chat template, thinking off, then the tokenizer)
    with the carried Klein folder's tokenizer (ComfyUI's ``qwen25_tokenizer`` with Qwen3's template)
    gives the ids of ComfyUI's own Klein tokenizer (its prompt template), before the padding."""
    try:
        from comfy.text_encoders.flux import KleinTokenizer
    except ImportError:
        pytest.skip("this ComfyUI tree has no FLUX.2 [klein] text encoder")
    carried = comfy.pack_submodule("offload_core.formats.carried")
    package = comfy.pack_submodule("nodes.model_files").comfy_package()
    ours = carried.shipped_tokenizer(carried.by_name("FLUX.2-klein-4B"), "tokenizer", "Qwen2Tokenizer", package)
    theirs = KleinTokenizer()
    for prompt in ("a red fox in the snow", "Ünïcødé — 東京の夜, neon signs", "two cats, one dog"):
        text = ours.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                        add_generation_prompt=True, enable_thinking=False)
        ids = [token[0] for token in theirs.tokenize_with_weights(prompt)["qwen3_4b"][0]]
        mine = ours(text)["input_ids"]
        assert mine == ids[:len(mine)] and set(ids[len(mine):]) <= {151643}, (text, ids)

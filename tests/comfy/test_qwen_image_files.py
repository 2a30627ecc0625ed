"""Qwen-Image from ComfyUI's files in a real ComfyUI: an fp8_scaled denoiser from an extra
diffusion_models path, the Qwen2.5-VL text encoder from text_encoders and the VAE (Wan 2.1's original
layout) from vae, loaded by Load diffusion model file into a Qwen-Image diffusers folder and run
through Generate image; the files are unchanged. The fixture's VAE layout is ComfyUI's own (its Wan
VAE class loads it strictly), and the carried Qwen-Image folder's tokenizer, read from the running
ComfyUI's own folder, with QwenImagePipeline's prompt template gives the ids ComfyUI's Qwen-Image
tokenizer gives, and drops the template where ComfyUI's encoder does. (Engine level, bit for bit,
every placement: tests/engine/test_qwen_image_single_file.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from comfyhost import harness
from comfyhost.single_files import generate_from_files
from fixtures.comfy_files import comfy_tensors
from fixtures.qwen_image_files import build_tiny_qwen_image, comfy_qwen_image_files, transformer_state
from safetensors.torch import load_file, save_file

pytest_plugins = ["comfyhost.fixtures"]


def test_comfyuis_qwen_image_files_load_into_a_qwen_image_folder_and_generate(comfy: harness.ComfyHost,
                                                                              tmp_path: Path) -> None:
    folder = build_tiny_qwen_image(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]) / "tiny" / "qwen-image")
    denoiser = tmp_path / "qwen_image_tiny_fp8_scaled.safetensors"
    save_file(comfy_tensors(transformer_state(folder), "fp8_scaled"), str(denoiser))
    parts = comfy_qwen_image_files(folder, tmp_path / "parts")
    report = generate_from_files(comfy, "tiny/qwen-image", denoiser, parts,
                                 {"negative_prompt": "blurry", "guidance": 2.0}, tmp_path)
    assert "QwenImagePipeline" in report and "fp8" in report, report
    shutil.rmtree(folder)


def test_the_fixtures_vae_layout_is_comfyuis_wan_vae(comfy: harness.ComfyHost, tmp_path: Path) -> None:
    """ComfyUI's Wan VAE class (what it builds for ``qwen_image_vae``), at the tiny VAE's widths, takes
    the fixture's original-layout file strictly: the converter the pack relies on is fed ComfyUI's names."""
    from comfy.ldm.wan.vae import WanVAE

    folder = build_tiny_qwen_image(tmp_path / "qwen-image")
    state = load_file(str(comfy_qwen_image_files(folder, tmp_path / "parts")["vae"]))
    vae = WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
    vae.load_state_dict(state, strict=True)
    assert all(torch.equal(vae.state_dict()[k], t) for k, t in state.items())


def test_the_carried_qwen_image_tokenizer_reads_prompts_as_comfyuis_qwen_image_tokenizer(
        comfy: harness.ComfyHost) -> None:
    """QwenImagePipeline's reading of a prompt (its template, then the tokenizer) with the carried
    Qwen-Image folder's tokenizer (ComfyUI's ``qwen25_tokenizer``) gives ComfyUI's ids, and the
    pipeline's fixed template drop (34 tokens) is where ComfyUI's encoder cuts (after ``user\\n``)."""
    import diffusers
    from comfy.text_encoders.qwen_image import QwenImageTokenizer

    carried = comfy.pack_submodule("offload_core.formats.carried")
    package = comfy.pack_submodule("nodes.model_files").comfy_package()
    ours = carried.shipped_tokenizer(carried.by_name("Qwen-Image"), "tokenizer", "Qwen2Tokenizer", package)
    pipe = diffusers.QwenImagePipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=None,
                                       text_encoder=None, tokenizer=ours, transformer=None)
    theirs = QwenImageTokenizer()
    for prompt in ("a red fox in the snow", "Ünïcødé — 東京の夜, neon signs", 'a sign that says "OPEN"'):
        ids = [token[0] for token in theirs.tokenize_with_weights(prompt)["qwen25_7b"][0]]
        assert ours(pipe.prompt_template_encode.format(prompt))["input_ids"] == ids
        starts = [i for i, t in enumerate(ids) if t == 151644]  # <|im_start|>: ComfyUI cuts after the second's "user\n"
        assert ids[starts[1] + 1:starts[1] + 3] == [872, 198] and starts[1] + 3 == pipe.prompt_template_encode_start_idx

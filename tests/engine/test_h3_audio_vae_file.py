"""MiniMax-H3's audio VAE from a single file (`load_audio_vae_file`): ComfyUI's layout (weight-norm
convolutions folded into one weight each, latent statistics as tensors) or diffusers'. Loaded into
the folder's audio VAE config, the run gives the folder's audio and video bit for bit; the file is
never written; a file that cannot be H3's audio VAE is refused by name."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core.formats.inspect import SingleFileError
from diffusers_offload.offload_core.models.minimax_h3.audio_vae_file import load_audio_vae_file
from fixtures.h3_files import comfy_h3_audio_vae_state_dict, write
from fixtures.quantized import digest
from fixtures.tiny_pipes import run_h3_fl2va


@pytest.mark.parametrize("layout", ["comfyui", "diffusers"])
def test_an_h3_audio_vae_file_gives_the_folders_audio(h3_fl2va_pipe, tiny_h3_dir, tmp_path, layout):
    pipe = h3_fl2va_pipe
    original = pipe.audio_vae
    reference = run_h3_fl2va(pipe)
    state = comfy_h3_audio_vae_state_dict(original) if layout == "comfyui" else original.state_dict()
    path = write(state, tmp_path / f"h3-audio-vae-{layout}.safetensors")
    before = digest(path)

    vae = load_audio_vae_file(path, tiny_h3_dir / "audio_vae", torch.bfloat16)

    normed = [n for n, m in vae.named_modules() if hasattr(m, "weight_g")]
    assert (normed == []) == (layout == "comfyui")  # folded convolutions hold the file's weight as it is
    assert {p.dtype for p in vae.parameters()} == {torch.float32}  # diffusers keeps it in float32
    assert list(vae.config.latents_mean) == list(original.config.latents_mean)
    try:
        pipe.update_components(audio_vae=vae)
        out = run_h3_fl2va(pipe)
    finally:
        pipe.update_components(audio_vae=original)
    torch.testing.assert_close(out.audio, reference.audio, rtol=0, atol=0)
    torch.testing.assert_close(out.video, reference.video, rtol=0, atol=0)
    assert digest(path) == before


def test_the_files_latent_statistics_are_the_ones_used(h3_fl2va_pipe, tiny_h3_dir, tmp_path):
    state = comfy_h3_audio_vae_state_dict(h3_fl2va_pipe.audio_vae)
    state["latents_std"] = 1 + torch.arange(len(state["latents_std"]), dtype=torch.float32) / 8
    vae = load_audio_vae_file(write(state, tmp_path / "audio.safetensors"), tiny_h3_dir / "audio_vae", torch.float32)
    assert list(vae.config.latents_std) == state["latents_std"].tolist()


def test_a_quantized_foreign_or_statless_audio_vae_file_is_refused_by_name(h3_fl2va_pipe, tiny_h3_dir, tmp_path):
    config = tiny_h3_dir / "audio_vae"
    state = comfy_h3_audio_vae_state_dict(h3_fl2va_pipe.audio_vae)
    conv = next(k for k in state if k.endswith(".weight") and state[k].dim() == 3)
    quantized = {**state, conv.replace(".weight", ".comfy_quant"): torch.tensor(list(b"{}"), dtype=torch.uint8)}
    with pytest.raises(SingleFileError, match=r"a-int8\.safetensors is a quantized audio VAE"):
        load_audio_vae_file(write(quantized, tmp_path / "a-int8.safetensors"), config, torch.float32)
    short = {k: v for k, v in state.items() if k != conv}
    with pytest.raises(SingleFileError, match=rf"short\.safetensors is not a MiniMax-H3 audio VAE .*{conv}"):
        load_audio_vae_file(write(short, tmp_path / "short.safetensors"), config, torch.float32)
    bare = {k: v for k, v in state.items() if not k.startswith("latents_")}
    folder = tmp_path / "configs" / "audio_vae"
    h3_fl2va_pipe.audio_vae.save_config(folder)  # the same config without statistics, as the pack carries it
    (folder / "config.json").write_text((folder / "config.json").read_text().replace(
        '"latents_mean": [', '"unused_mean": [').replace('"latents_std": [', '"unused_std": ['))
    with pytest.raises(SingleFileError, match=r"bare\.safetensors holds no latents_mean / latents_std"):
        load_audio_vae_file(write(bare, tmp_path / "bare.safetensors"), folder, torch.float32)

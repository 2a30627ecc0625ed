"""MiniMax-H3's video VAE from a single file (`load_vae_file`): ComfyUI's layout (renamed modules,
fused per-head ``to_qkv``, the gate-first FFN, latent statistics as tensors) or diffusers'. Loaded
into the folder's VAE config, the weights are the folder's bit for bit and the fl2va run (two
keyframe encodes, one decode) gives the same frames; ComfyUI's int8 (convrot) decoder is decoded as
comfy-kitchen decodes it; the file is never written."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers_offload.offload_core.formats.inspect import SingleFileError
from diffusers_offload.offload_core.models.minimax_h3.vae_file import load_vae_file
from fixtures.comfy_files import int8_tensors
from fixtures.h3_files import comfy_h3_vae_state_dict, write
from fixtures.quantized import digest
from fixtures.tiny_pipes import run_h3_fl2va


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("layout", ["comfyui", "diffusers"])
def test_an_h3_vae_file_loads_the_folders_weights_and_decodes_the_same(h3_fl2va_pipe, tiny_h3_dir, tmp_path, layout):
    pipe = h3_fl2va_pipe
    reference = run_h3_fl2va(pipe)
    state = comfy_h3_vae_state_dict(pipe.vae) if layout == "comfyui" else pipe.vae.state_dict()
    path = write(state, tmp_path / f"h3-vae-{layout}.safetensors")
    before = digest(path)

    vae = load_vae_file(path, tiny_h3_dir / "vae", pipe.vae.dtype)

    _same_weights(vae, pipe.vae)
    assert list(vae.config.latents_mean) == list(pipe.vae.config.latents_mean)
    pipe.update_components(vae=vae)
    out = run_h3_fl2va(pipe)
    torch.testing.assert_close(out.video, reference.video, rtol=0, atol=0)
    torch.testing.assert_close(out.audio, reference.audio, rtol=0, atol=0)
    assert digest(path) == before


def test_the_files_latent_statistics_are_the_ones_used(h3_fl2va_pipe, tiny_h3_dir, tmp_path):
    state = comfy_h3_vae_state_dict(h3_fl2va_pipe.vae)
    state["latents_mean"] = torch.arange(len(state["latents_mean"]), dtype=torch.float32) / 8
    vae = load_vae_file(write(state, tmp_path / "vae.safetensors"), tiny_h3_dir / "vae", torch.float32)
    assert list(vae.config.latents_mean) == state["latents_mean"].tolist()


def test_comfyuis_int8_convrot_decoder_is_decoded_as_comfy_kitchen_decodes_it(h3_fl2va_pipe, tiny_h3_dir, tmp_path):
    """The decoder's matrices as ComfyUI's int8 decoder file holds them (comfy-kitchen's convrot int8
    where group 4 divides the width, plain per-row int8 elsewhere): loaded, each weight is
    comfy-kitchen's own dequantisation in float32, bit for bit, and the file is never written."""
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout

    state = comfy_h3_vae_state_dict(h3_fl2va_pipe.vae)
    matrices = {k: v for k, v in state.items() if k.startswith("decoder.transformer_blocks.") and v.ndim == 2}
    quantized, _header = int8_tensors(matrices, per_row=True, convrot=4)
    path = write({**state, **quantized}, tmp_path / "h3-vae-int8-convrot.safetensors")
    before = digest(path)
    dense = dict(state)
    for key in matrices:
        layer = key.removesuffix(".weight")
        q, scale = quantized[key], quantized[f"{layer}.weight_scale"]
        conf = json.loads(bytes(quantized[f"{layer}.comfy_quant"].tolist()))
        params = TensorWiseINT8Layout.Params(scale=scale, orig_dtype=torch.float32, orig_shape=tuple(q.shape),
                                             convrot=bool(conf.get("convrot")), convrot_groupsize=4)
        dense[key] = TensorWiseINT8Layout.dequantize(q, params)
    assert any(json.loads(bytes(v.tolist())).get("convrot") for k, v in quantized.items() if k.endswith("comfy_quant"))
    vae = load_vae_file(path, tiny_h3_dir / "vae", torch.float32)
    _same_weights(vae, load_vae_file(write(dense, tmp_path / "dense.safetensors"), tiny_h3_dir / "vae", torch.float32))
    assert digest(path) == before


def test_a_quantized_or_foreign_vae_file_is_refused_by_name(h3_fl2va_pipe, tiny_h3_dir, tmp_path):
    state = comfy_h3_vae_state_dict(h3_fl2va_pipe.vae)
    quantized = {**state, "decoder.transformer_blocks.0.ff.w1.comfy_quant": torch.tensor(list(b"{}"), dtype=torch.uint8)}
    with pytest.raises(SingleFileError, match=r"h3-int8\.safetensors is a quantized VAE .*comfy_quant"):
        load_vae_file(write(quantized, tmp_path / "h3-int8.safetensors"), tiny_h3_dir / "vae", torch.float32)
    short = {k: v for k, v in state.items() if not k.startswith("decoder.norm_out.")}
    with pytest.raises(SingleFileError, match=r"short\.safetensors is not a MiniMax-H3 video VAE .*decoder\.norm_out"):
        load_vae_file(write(short, tmp_path / "short.safetensors"), tiny_h3_dir / "vae", torch.float32)

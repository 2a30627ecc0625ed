"""ComfyUI MXFP8 single files (comfy-kitchen's ``TensorCoreMXFP8Layout``, quantized here by
comfy-kitchen itself): loaded with their fp8 weights and E8M0 block scales kept as stored (told from
fp8_scaled layers, whose scale has the same name, by their entries), and run, in every placement,
bit for bit like ComfyUI's layer below Blackwell (comfy-kitchen's ``QuantizedTensor`` under
``nn.Linear``: the weight decoded); widths padded to 32 cut back; storage bytes streamed; a fused
layer diffusers splits takes its rows' scales; bad files refused by name; no file changes."""

import sys
from pathlib import Path

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats.mxfp8 import MXFP8Linear, kitchen
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.stored_linear import kitchen_module
from fixtures.mxfp8_files import (
    comfy_mxfp8_wan_tensors,
    comfyui_mxfp8_twin,
    mxfp8_layers,
    write_comfy_mxfp8_wan,
)
from fixtures.placements import PLACEMENTS
from fixtures.quantized import assert_streams_stored_bytes, digest, refused, runs_as_keeping_stored, wan_pipe
from fixtures.tiny_models import run_wan
from safetensors.torch import load_file, save_file

BF16 = torch.bfloat16
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
E8M0 = torch.float8_e8m0fnu


@pytest.fixture(scope="module")
def mxfp8_file(tiny_wan_dir, tmp_path_factory) -> Path:
    return write_comfy_mxfp8_wan(tiny_wan_dir, tmp_path_factory.mktemp("mxfp8") / "wan-tiny-mxfp8.safetensors")


@pytest.fixture(scope="module")
def reference(tiny_wan_dir, mxfp8_file, tmp_path_factory) -> torch.Tensor:
    return run_wan(wan_pipe(tiny_wan_dir, comfyui_mxfp8_twin(mxfp8_file, tiny_wan_dir, tmp_path_factory.mktemp("t"))))


def test_the_file_is_comfy_kitchens_mxfp8_padded(mxfp8_file):
    tensors = load_file(str(mxfp8_file))
    q, scale = tensors["blocks.0.self_attn.q.weight"], tensors["blocks.0.self_attn.q.weight_scale"]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (32, 32) and scale.dtype == E8M0 and scale.shape == (128, 4)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_mxfp8_file_runs_as_comfyui_in_every_placement(placement, tiny_wan_dir, mxfp8_file, reference):
    before = digest(mxfp8_file)
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(mxfp8_file, tiny_wan_dir, BF16))
    model = pipe.transformer
    assert isinstance(model.blocks[0].attn1.to_q, MXFP8Linear) and isinstance(model.proj_out, MXFP8Linear)
    assert model.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32  # decoded, fp32 module
    runs_as_keeping_stored(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), reference, (torch.float8_e4m3fn, E8M0))
    assert digest(mxfp8_file) == before


def test_streamer_moves_mxfp8_storage_bytes(tiny_wan_dir, mxfp8_file, monkeypatch):
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(mxfp8_file, tiny_wan_dir, BF16))
    assert_streams_stored_bytes(pipe, monkeypatch, {torch.float8_e4m3fn, E8M0}, "comfy mxfp8", **BASE)


def test_an_h3_mxfp8_file_in_comfy_layout_splits_fused_layers_row_by_row(tmp_path):
    """(`h3_files.assert_splits_row_by_row`: each part takes its rows' block scales, re-tiled.)"""
    from fixtures.h3_files import assert_splits_row_by_row

    assert_splits_row_by_row(tmp_path, mxfp8_layers,
                             lambda t: kitchen().dequantize_mxfp8(t("weight"), t("weight_scale"), BF16), MXFP8Linear)


@pytest.mark.parametrize("fault, match", [
    ("wrong_blocks", r"blocks\.0\.self_attn\.q is declared mxfp8 but the file holds block scales of shape \(128, 8\)"),
    ("bf16_weight", r"blocks\.0\.self_attn\.q is declared mxfp8 but the file holds a bfloat16 weight"),
    ("no_scale", r"blocks\.0\.self_attn\.q is declared mxfp8 but the file holds no weight_scale"),
])
def test_inconsistent_mxfp8_files_are_refused(fault, match, tiny_wan_dir, tmp_path):
    tensors = comfy_mxfp8_wan_tensors(tiny_wan_dir)
    layer = "blocks.0.self_attn.q"
    if fault == "wrong_blocks":
        tensors[f"{layer}.weight_scale"] = torch.zeros(128, 8, dtype=torch.uint8).view(E8M0)
    elif fault == "bf16_weight":
        tensors[f"{layer}.weight"] = torch.zeros(24, 24, dtype=BF16)
    else:
        tensors.pop(f"{layer}.weight_scale")
    path = tmp_path / f"wan-mxfp8-{fault}.safetensors"
    save_file(tensors, str(path))
    refused(match, path, tiny_wan_dir)


def test_without_comfy_kitchen_an_mxfp8_file_is_refused_naming_it(tiny_wan_dir, mxfp8_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # import fails as if not installed
    kitchen_module.cache_clear()
    err = refused(r"is an MXFP8 file: MXFP8 files run through comfy-kitchen", mxfp8_file, tiny_wan_dir)
    assert "pip install comfy-kitchen" in str(err)
    kitchen_module.cache_clear()



def test_a_text_encoder_mixing_mxfp8_and_int8_layers_keeps_both_as_stored(tiny_wan_dir, tmp_path):
    """The tiny UMT5 file with MXFP8 attention and int8_tensorwise gated input projections: the MXFP8
    layers' fp8 weights are not fp8 storage of the file's own, so its int8 layers stay int8 (were
    decoded at load); the encoder gives the bits of the file with every layer decoded."""
    from diffusers_offload.offload_core.formats.fp8 import dequantize_int8, table_of
    from diffusers_offload.offload_core.formats.single_file_pipeline import load_text_encoder
    from fixtures.comfy_files import int8_tensors, write_component_file
    from fixtures.quantized import encoded

    source = load_file(str(write_component_file(tiny_wan_dir, "text_encoder", tmp_path / "umt5.safetensors")))
    attention = [k.removesuffix(".weight") for k in source if ".SelfAttention." in k and "relative" not in k]
    gated = [k.removesuffix(".weight") for k in source if ".DenseReluDense.wi" in k]
    int8, _ = int8_tensors({f"{n}.weight": source.pop(f"{n}.weight") for n in gated})
    tensors = mxfp8_layers(source, attention) | int8
    path = tmp_path / "umt5-tiny-mxfp8-int8.safetensors"
    save_file(tensors, str(path))
    before = digest(path)
    encoder = load_text_encoder(path, tiny_wan_dir / "text_encoder", "UMT5EncoderModel", BF16)
    assert all(isinstance(encoder.get_submodule(n), MXFP8Linear) for n in attention)
    assert {encoder.get_submodule(n).weight.dtype for n in gated} == {torch.int8} and table_of(encoder).int8
    dense = {k: t for k, t in tensors.items() if not k.endswith((".weight_scale", ".comfy_quant"))}
    for layer in attention:
        rows, cols = encoder.get_submodule(layer).out_features, encoder.get_submodule(layer).in_features
        dense[f"{layer}.weight"] = kitchen().dequantize_mxfp8(tensors[f"{layer}.weight"], tensors[f"{layer}.weight_scale"],
                                                              BF16)[:rows, :cols].contiguous()
    for layer in gated:
        dense[f"{layer}.weight"] = dequantize_int8(tensors[f"{layer}.weight"], tensors[f"{layer}.weight_scale"], BF16)
    save_file(dense, str(tmp_path / "umt5-dense.safetensors"))
    reference = load_text_encoder(tmp_path / "umt5-dense.safetensors", tiny_wan_dir / "text_encoder", "UMT5EncoderModel",
                                  BF16)
    got, want = (encoded(wan_pipe(tiny_wan_dir, text_encoder=e)) for e in (encoder, reference))
    assert torch.equal(got, want)
    assert digest(path) == before

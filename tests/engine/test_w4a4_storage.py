"""ComfyUI ConvRot W4A4 single files (comfy-kitchen's ``convrot_w4a4``, quantized here by
comfy-kitchen itself): loaded with their packed int4 weights and row scales kept as stored (told
from int8_tensorwise layers, stored alike, by their entries), and run, in every placement, bit for bit
like ComfyUI's layer (comfy-kitchen's ``convrot_w4a4_linear`` through its ``QuantizedTensor``);
storage bytes streamed; LoRA unfused and off bit-exactly; bad files refused by name; no file changes."""

from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.w4a4 import W4A4Linear
from diffusers_offload.offload_core.lora import LoraSpec, activate
from diffusers_offload.offload_core.state import leftovers
from fixtures import comfy_files
from fixtures.placements import PLACEMENTS
from fixtures.quantized import assert_streams_stored_bytes, digest, refused, runs_as_keeping_stored, wan_pipe
from fixtures.tiny_loras import wan_lora
from fixtures.tiny_models import run_wan
from fixtures.w4a4_files import comfy_w4a4_wan_tensors, comfyui_w4a4_twin, write_comfy_w4a4_wan
from safetensors.torch import load_file, save_file

_wide_wan_dir = comfy_files.wide_wan_dir  # (session fixture, under its name)
BF16 = torch.bfloat16
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


@pytest.fixture(scope="module")
def w4a4_file(wide_wan_dir, tmp_path_factory) -> Path:
    return write_comfy_w4a4_wan(wide_wan_dir, tmp_path_factory.mktemp("w4a4") / "wan-wide-w4a4.safetensors")


@pytest.fixture(scope="module")
def reference(tiny_wan_dir, wide_wan_dir, w4a4_file, tmp_path_factory) -> torch.Tensor:
    twin = comfyui_w4a4_twin(w4a4_file, wide_wan_dir, tmp_path_factory.mktemp("twin"))
    return run_wan(wan_pipe(tiny_wan_dir, twin))


def test_the_file_holds_comfy_kitchens_w4a4_as_int8_with_row_scales(w4a4_file):
    tensors = load_file(str(w4a4_file))
    q, scale = tensors["blocks.0.self_attn.q.weight"], tensors["blocks.0.self_attn.q.weight_scale"]
    assert q.dtype == torch.int8 and q.shape == (64, 32) and scale.shape == (64,)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_w4a4_file_runs_as_comfyui_in_every_placement(placement, tiny_wan_dir, wide_wan_dir, w4a4_file, reference):
    before = digest(w4a4_file)
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(w4a4_file, wide_wan_dir, BF16))
    model = pipe.transformer
    assert isinstance(model.blocks[0].attn1.to_q, W4A4Linear) and isinstance(model.proj_out, W4A4Linear)
    assert model.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32  # decoded, fp32 module
    runs_as_keeping_stored(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), reference, (torch.int8,))
    assert digest(w4a4_file) == before


def test_streamer_moves_w4a4_storage_bytes(tiny_wan_dir, wide_wan_dir, w4a4_file, monkeypatch):
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(w4a4_file, wide_wan_dir, BF16))
    assert_streams_stored_bytes(pipe, monkeypatch, {torch.int8, torch.float32}, "comfy convrot_w4a4", **BASE)


@pytest.mark.parametrize("placement", ["none", "auto", "leaf"])
def test_lora_on_w4a4_layers_is_unfused_and_comes_off_bit_exactly(placement, tiny_wan_dir, wide_wan_dir, w4a4_file,
                                                                   reference, tmp_path):
    plain = WanTransformer3DModel.from_pretrained(str(wide_wan_dir / "transformer"), torch_dtype=BF16)
    lora = wan_lora(plain, tmp_path, seed=9, targets=("to_q", "ffn.net.2"))
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(w4a4_file, wide_wan_dir, BF16))
    stored = {n: t.clone() for n, t in pipe.transformer.state_dict().items() if t.dtype == torch.int8}
    engine = Engine()
    engine.place(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE))
    activate(pipe, [LoraSpec(str(lora))])
    assert not torch.equal(run_wan(pipe), reference)
    details = engine.report(pipe).component("transformer").details["lora"]
    assert details["path"] == "unfused" and set(details["unfused"].values()) == {"w4a4"}
    assert all(torch.equal(pipe.transformer.state_dict()[n], t) for n, t in stored.items())
    activate(pipe, [])
    assert torch.equal(run_wan(pipe), reference)
    engine.release(pipe)
    assert leftovers(pipe.transformer) == []


@pytest.mark.parametrize("fault, match", [
    ("no_scale", r"blocks\.0\.self_attn\.q is declared convrot_w4a4 but the file holds no weight_scale"),
    ("short_scale", r"blocks\.0\.self_attn\.q is declared convrot_w4a4 but the file holds a weight_scale of shape \(32,\)"),
    ("narrow", r"blocks\.0\.self_attn\.q is declared convrot_w4a4 but the file holds its input width 32 is not a "
               r"multiple of 64"),
    ("two_rotations", r"its ConvRot W4A4 \(convrot_w4a4\) layers use 2 rotations or linears .*one per file"),
])
def test_inconsistent_w4a4_files_are_refused(fault, match, tiny_wan_dir, wide_wan_dir, tmp_path):
    tensors = comfy_w4a4_wan_tensors(wide_wan_dir)
    layer = "blocks.0.self_attn.q"
    if fault == "no_scale":
        tensors.pop(f"{layer}.weight_scale")
    elif fault == "short_scale":
        tensors[f"{layer}.weight_scale"] = tensors[f"{layer}.weight_scale"][:32]
    elif fault == "narrow":
        tensors[f"{layer}.weight"] = tensors[f"{layer}.weight"][:, :16].contiguous()
    else:
        other = comfy_w4a4_wan_tensors(wide_wan_dir, {"format": "convrot_w4a4", "convrot_groupsize": 64})
        tensors |= {k: v for k, v in other.items() if k.startswith("blocks.1.")}
    path = tmp_path / f"wan-w4a4-{fault}.safetensors"
    save_file(tensors, str(path))
    refused(match, path, wide_wan_dir)


def test_a_w4a4_text_encoder_keeps_its_layers_and_encodes_as_comfyui(tmp_path):
    """A UMT5 text-encoder file (transformers' names) with W4A4 matrices: they stay W4A4 and the
    encoder gives the bits of the same encoder holding each as ComfyUI does."""
    from comfy_kitchen.tensor.base import QuantizedTensor
    from comfy_kitchen.tensor.convrot_w4a4 import TensorCoreConvRotW4A4Layout
    from diffusers_offload.offload_core.formats.single_file_pipeline import load_text_encoder
    from fixtures.w4a4_files import GROUP, w4a4_layers
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(3)
    config = UMT5Config(vocab_size=64, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8)
    twin = UMT5EncoderModel(config).to(BF16).eval()
    twin.save_pretrained(tmp_path / "text_encoder")
    state = {k: v.clone() for k, v in twin.state_dict().items() if k != "encoder.embed_tokens.weight"}  # (tied)
    layers = [k.removesuffix(".weight") for k, v in state.items() if ".layer." in k and v.ndim == 2 and v.shape[1] % 64 == 0]
    path = tmp_path / "umt5-tiny-w4a4.safetensors"
    save_file(w4a4_layers(state, layers), str(path))
    before = digest(path)
    encoder = load_text_encoder(path, tmp_path / "text_encoder", "UMT5EncoderModel", BF16)
    tensors = load_file(str(path))
    for layer in layers:
        assert isinstance(encoder.get_submodule(layer), W4A4Linear), layer
        linear = twin.get_submodule(layer)
        params = TensorCoreConvRotW4A4Layout.Params(scale=tensors[f"{layer}.weight_scale"], orig_dtype=BF16,
                                                    orig_shape=tuple(linear.weight.shape), convrot_groupsize=GROUP,
                                                    quant_group_size=64)
        linear.weight = torch.nn.Parameter(
            QuantizedTensor(tensors[f"{layer}.weight"], "TensorCoreConvRotW4A4Layout", params), requires_grad=False)
    ids = torch.tensor([[3, 7, 11, 2, 9, 1]])
    with torch.inference_mode():
        assert torch.equal(encoder(ids).last_hidden_state, twin(ids).last_hidden_state)
    assert digest(path) == before


def test_an_h3_w4a4_file_in_comfy_layout_splits_fused_layers_row_by_row(tmp_path):
    """(`h3_files.assert_splits_row_by_row`: each part takes its rows' scales; width 64, what
    comfy-kitchen's groups divide.)"""
    from comfy_kitchen.tensor.convrot_w4a4 import dequantize_convrot_w4a4_weight
    from fixtures.h3_files import assert_splits_row_by_row
    from fixtures.w4a4_files import GROUP, w4a4_layers

    assert_splits_row_by_row(tmp_path, w4a4_layers, lambda t: dequantize_convrot_w4a4_weight(
        t("weight"), t("weight_scale"), GROUP, 64, BF16), W4A4Linear, heads=4, width=64)

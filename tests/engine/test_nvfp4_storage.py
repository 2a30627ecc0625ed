"""ComfyUI NVFP4 single files (comfy-kitchen's ``TensorCoreNVFP4Layout``, quantized here by
comfy-kitchen itself): loaded with their packed fp4 weights, block scales and tensor scales kept as
stored, and run, in every placement, bit for bit like ComfyUI's layer on a card without fp4 tensor
cores — the same model with each such weight a comfy-kitchen ``QuantizedTensor`` under a plain
``nn.Linear`` (its linear falls back to the decoded weight) and an AWQ layer's input scaled first,
as ComfyUI's mixed precision ops do; widths padded to 16 are cut back; what the streamer moves is
storage bytes; LoRA is unfused and comes off bit-exactly; bad files are refused by name; no file changes."""

import sys
from pathlib import Path

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.nvfp4 import NVFP4Linear, kitchen
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.stored_linear import kitchen_module
from diffusers_offload.offload_core.lora import LoraSpec, activate
from diffusers_offload.offload_core.state import leftovers
from fixtures.nvfp4_files import AWQ_LAYER, comfy_nvfp4_wan_tensors, comfyui_nvfp4_twin, write_comfy_nvfp4_wan
from fixtures.placements import PLACEMENTS
from fixtures.quantized import assert_streams_stored_bytes, digest, refused, runs_as_keeping_stored, wan_pipe
from fixtures.tiny_loras import wan_lora
from fixtures.tiny_models import load_wan, run_wan
from safetensors.torch import load_file, save_file

BF16 = torch.bfloat16
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
STORED = (torch.uint8, torch.float8_e4m3fn)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, detached (an NVFP4 layer's scales are buffers)."""
    return {n: t.detach() for n, t in (*model.named_parameters(), *model.named_buffers())}


@pytest.fixture(scope="module")
def nvfp4_file(tiny_wan_dir, tmp_path_factory) -> Path:
    return write_comfy_nvfp4_wan(tiny_wan_dir, tmp_path_factory.mktemp("nvfp4") / "wan-tiny-nvfp4.safetensors")


@pytest.fixture(scope="module")
def reference(tiny_wan_dir, nvfp4_file, tmp_path_factory) -> torch.Tensor:
    return run_wan(wan_pipe(tiny_wan_dir, comfyui_nvfp4_twin(nvfp4_file, tiny_wan_dir, tmp_path_factory.mktemp("twin"))))


def test_the_file_is_comfy_kitchens_nvfp4_padded(nvfp4_file, tiny_wan_dir):
    """Packed uint8 weights padded to 16 x 16 (the tiny Wan's width 24 becomes 32), fp8 block scales
    in comfy-kitchen's tiled layout, on the blocks (streamed) and outside them."""
    tensors = load_file(str(nvfp4_file))
    q = tensors["blocks.0.self_attn.q.weight"]
    assert q.dtype == torch.uint8 and q.shape == (32, 16)
    assert tensors["blocks.0.self_attn.q.weight_scale"].shape == (128, 4)
    assert tensors["blocks.0.self_attn.q.weight_scale"].dtype == torch.float8_e4m3fn
    assert "head.head.weight_scale_2" in tensors and f"{AWQ_LAYER}.pre_quant_scale" in tensors


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_nvfp4_file_runs_as_comfyui_in_every_placement(placement, tiny_wan_dir, nvfp4_file, reference):
    before = digest(nvfp4_file)
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(nvfp4_file, tiny_wan_dir, BF16))
    model = pipe.transformer
    assert any(isinstance(m, NVFP4Linear) for m in model.blocks.modules()) and isinstance(model.proj_out, NVFP4Linear)
    assert model.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32  # decoded, fp32 module
    assert model.dtype == BF16
    runs_as_keeping_stored(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), reference, STORED)
    assert digest(nvfp4_file) == before


def test_the_awq_input_scaling_is_applied(tiny_wan_dir, nvfp4_file, reference):
    """Dropping the AWQ layer's input scaling changes the output (the placement test cannot pass
    with the scaling ignored)."""
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(nvfp4_file, tiny_wan_dir, BF16))
    layer = pipe.transformer.blocks[1].ffn.net[2]
    assert isinstance(layer, NVFP4Linear) and layer.pre_quant_scale is not None
    layer.pre_quant_scale = None
    assert not torch.allclose(run_wan(pipe), reference, atol=1e-3)


def test_streamer_moves_nvfp4_storage_bytes(tiny_wan_dir, nvfp4_file, monkeypatch):
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(nvfp4_file, tiny_wan_dir, BF16))
    assert_streams_stored_bytes(pipe, monkeypatch, {torch.uint8, torch.float8_e4m3fn}, "comfy nvfp4", **BASE)


LORA_TARGETS = ("to_q", "ffn.net.2")


@pytest.fixture(scope="module")
def nvfp4_lora(tiny_wan_dir, tmp_path_factory) -> Path:
    return wan_lora(load_wan(tiny_wan_dir).transformer, tmp_path_factory.mktemp("nvfp4-lora"), seed=7,
                    targets=LORA_TARGETS)


@pytest.mark.parametrize("placement", ["none", "auto", "leaf"])
def test_lora_on_nvfp4_layers_is_unfused_and_comes_off_bit_exactly(placement, tiny_wan_dir, nvfp4_file, nvfp4_lora,
                                                                    reference):
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(nvfp4_file, tiny_wan_dir, BF16))
    model = pipe.transformer
    stored = {n: t.clone() for n, t in _tensors(model).items() if t.dtype in STORED}
    engine = Engine()
    engine.place(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE))
    activate(pipe, [LoraSpec(str(nvfp4_lora))])
    with_lora = run_wan(pipe)
    assert not torch.equal(with_lora, reference)
    lora = engine.report(pipe).component("transformer").details["lora"]
    assert lora["path"] == "unfused" and set(lora["unfused"].values()) == {"nvfp4"}
    assert all(torch.equal(_tensors(model)[n], t) for n, t in stored.items()), "an NVFP4 tensor was written"
    activate(pipe, [])
    assert torch.equal(run_wan(pipe), reference)
    engine.release(pipe)
    assert leftovers(model) == []


# -- refused by name, files untouched ---------------------------------------------------------------

@pytest.mark.parametrize("fault, match", [
    ("no_tensor_scale", r"blocks\.0\.self_attn\.q is declared nvfp4 but the file holds no weight_scale_2"),
    ("wrong_blocks", r"blocks\.0\.self_attn\.q is declared nvfp4 but the file holds block scales of shape \(128, 8\)"),
    ("bf16_weight", r"blocks\.0\.self_attn\.q is declared nvfp4 but the file holds a bfloat16 weight"),
])
def test_inconsistent_nvfp4_files_are_refused(fault, match, tiny_wan_dir, tmp_path):
    tensors = comfy_nvfp4_wan_tensors(tiny_wan_dir)
    layer = "blocks.0.self_attn.q"
    if fault == "no_tensor_scale":
        tensors.pop(f"{layer}.weight_scale_2")
    elif fault == "wrong_blocks":
        tensors[f"{layer}.weight_scale"] = torch.zeros(128, 8, dtype=torch.float8_e4m3fn)
    else:
        tensors[f"{layer}.weight"] = torch.zeros(24, 24, dtype=BF16)
    path = tmp_path / f"wan-nvfp4-{fault}.safetensors"
    save_file(tensors, str(path))
    refused(match, path, tiny_wan_dir)


def test_without_comfy_kitchen_an_nvfp4_file_is_refused_naming_it(tiny_wan_dir, nvfp4_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # import fails as if not installed
    kitchen_module.cache_clear()
    err = refused(r"is an NVFP4 file: NVFP4 files run through comfy-kitchen, which this Python does not have",
                  nvfp4_file, tiny_wan_dir)
    assert "pip install comfy-kitchen" in str(err)
    kitchen_module.cache_clear()


def test_an_h3_nvfp4_file_in_comfy_layout_splits_fused_layers_row_by_row(tmp_path):
    """(`h3_files.assert_splits_row_by_row`: each part takes its rows' block scales, re-tiled.)"""
    from fixtures.h3_files import assert_splits_row_by_row
    from fixtures.nvfp4_files import nvfp4_layers

    assert_splits_row_by_row(tmp_path, nvfp4_layers, lambda t: kitchen().dequantize_nvfp4(
        t("weight"), t("weight_scale_2"), t("weight_scale"), BF16), NVFP4Linear)

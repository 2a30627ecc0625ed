"""MiniMax-H3 from a ComfyUI W4A8 file in the Comfy-Org layout (how H3 circulates): the tiny H3
pipeline with that transformer runs t2va, in mode none and streamed, equal bit for bit to the same
pipeline whose transformer holds each W4A8 layer as ComfyUI does (comfy-kitchen's
``QuantizedTensor`` under ``nn.Linear``, from comfy-kitchen's quantization of the model's own
weights: W4A8 quantizes row by row, so that equals the file's layers after diffusers' conversion,
which `test_w4a8_storage` checks)."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines import ModularPipeline
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.w4a8 import W4A8Linear
from diffusers_offload.offload_core.state import leftovers
from fixtures.h3_files import build_wide_h3, comfy_h3_state_dict, w4a8_layers, write
from fixtures.tiny_models import run_h3

BF16 = torch.bfloat16
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
GEOMETRY = dict(group_size=16, convrot_groupsize=16)


def _comfyui_twin(original: MiniMaxH3Transformer3DModel, layers: list[str]) -> MiniMaxH3Transformer3DModel:
    """``original`` with each of its Linear layers the file stores as W4A8 held as ComfyUI holds it;
    those in diffusers' fp32 modules hold the decoded values."""
    from comfy_kitchen.tensor.base import QuantizedTensor
    from comfy_kitchen.tensor.w4a8_int8 import (
        AsymW4A8Int8Layout,
        dequantize_w4a8_int8_weight,
        quantize_w4a8_int8_weight,
    )

    twin = copy.deepcopy(original)
    for name, linear in twin.named_modules():
        if not (isinstance(linear, torch.nn.Linear) and linear.in_features % 16 == 0):
            continue
        q, s_rel, s_channel, _correction, codebook = quantize_w4a8_int8_weight(linear.weight.data.to(BF16), **GEOMETRY)
        if name not in layers:  # a layer diffusers keeps in fp32: the file's W4A8 values, decoded
            linear.weight.data = dequantize_w4a8_int8_weight(q, s_rel, s_channel, codebook=codebook,
                                                             output_dtype=BF16, **GEOMETRY).float()
            continue
        params = AsymW4A8Int8Layout.Params(scale=s_rel, s_channel=s_channel, codebook=codebook, orig_dtype=BF16,
                                           orig_shape=tuple(linear.weight.shape), **GEOMETRY)
        linear.weight = torch.nn.Parameter(QuantizedTensor(q, "AsymW4A8Int8Layout", params), requires_grad=False)
    return twin


@pytest.fixture(scope="module")
def case(tiny_h3_dir, tmp_path_factory):
    """(the tiny H3 pipeline, the transformer loaded from the W4A8 file, the twin's outputs)"""
    tmp = tmp_path_factory.mktemp("h3-w4a8")
    folder = build_wide_h3(tmp / "h3")
    original = MiniMaxH3Transformer3DModel.from_pretrained(str(folder / "transformer"), torch_dtype=BF16)
    path = write(w4a8_layers(comfy_h3_state_dict(original.state_dict(), dict(original.config))), tmp / "h3.safetensors")
    loaded = load_denoiser(path, folder, BF16)
    layers = [n for n, m in loaded.named_modules() if isinstance(m, W4A8Linear)]
    pipe = ModularPipeline.from_pretrained(tiny_h3_dir, workflow="t2va")
    pipe.load_components(dtype=BF16)
    pipe.set_progress_bar_config(disable=True)
    pipe.update_components(transformer=_comfyui_twin(original, layers))
    out = run_h3(pipe)
    pipe.update_components(transformer=loaded)
    return pipe, loaded, layers, (out.video, out.audio)


@pytest.mark.parametrize("placement", [dict(mode="none"), dict(mode="auto"), dict(mode="auto", preload="off")])
def test_h3_from_a_w4a8_file_runs_as_comfyui(case, placement):
    pipe, loaded, layers, expected = case
    assert any(n.startswith("transformer_blocks.") for n in layers)
    engine = Engine()
    engine.place(pipe, OffloadConfig(**placement, **BASE))
    out = run_h3(pipe)
    engine.release(pipe)
    assert torch.equal(out.video, expected[0]) and torch.equal(out.audio, expected[1])
    assert leftovers(loaded) == []

"""Quantizers diffusers loads besides GGUF and the pack's fp8 table (SPEC §11): the engine places
what it can move and refuses the rest by name, before anything is placed.

- torchao int8 weight-only rides the whole-module transports and is refused on the block
  streamer: tests/engine/test_torchao_moves.py. Here: its decision beside the others', and another
  torchao tensor type (not verified) refused by its type.
- bitsandbytes / optimum-quanto are not installed (bitsandbytes needs CUDA): only the decision
  is tested — quanto on a real diffusers ``QuantoConfig`` attached to a real tiny model,
  bitsandbytes on its method names (``BitsAndBytesConfig`` cannot be built without the library).
  Their real tensor types and resident runs are NOT covered here.
- every method in diffusers' quantizer mapping is decided: quanto and bitsandbytes are refused
  by name, torchao by name on the block streamer only; any other is moved when its weights are
  plain tensors and refused by their type when a weight is a tensor type the engine does not
  know (a real diffusers subclass here).
- BFL fp8r (a real single file loaded by diffusers' BFL quantizer) rides every transport: each
  mode and preload policy equals the resident model bit for bit; the fp8 bytes come back as they
  were. BFL nvfp4 is not covered (same plain-tensor layout, not built here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import BFLQuantizationConfig, QuantoConfig, WanTransformer3DModel
from diffusers.quantizers.auto import AUTO_QUANTIZER_MAPPING
from diffusers.quantizers.bfl.utils import BFLQuantizedParameter, quantize_fp8r
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.components import Components, describe
from diffusers_offload.offload_core.config import OffloadConfigError
from diffusers_offload.offload_core.guards import unmovable_quantization
from diffusers_offload.offload_core.state import leftovers
from fixtures.gguf_files import comfy_wan_state_dict
from fixtures.placements import PLACEMENTS
from fixtures.quantized import two_runs_placed
from fixtures.tiny_models import load_wan, run_wan
from safetensors.torch import save_file

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


@pytest.fixture
def tiny_transformer(tiny_wan_dir) -> WanTransformer3DModel:
    return WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer", torch_dtype=torch.float32)


def test_quanto_config_is_refused_when_moved_kept_when_resident(tiny_transformer):
    """Decision only: a real diffusers ``QuantoConfig`` on a real tiny model (where
    ``from_pretrained`` leaves it); the weights are not quantized (optimum-quanto is not installed)."""
    tiny_transformer.register_to_config(quantization_config=QuantoConfig(weights_dtype="int8"))
    assert describe("transformer", tiny_transformer).quantization == "quanto"
    pipe = Components(transformer=tiny_transformer)
    with pytest.raises(OffloadConfigError, match="transformer .* quantized by quanto: a tensor subclass"):
        Engine().place(pipe, OffloadConfig(mode="auto", **BASE))
    assert leftovers(tiny_transformer) == []
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="none", **BASE))
    engine.release(pipe)
    assert leftovers(tiny_transformer) == []


def test_every_diffusers_quantizer_is_decided():
    """Every method in diffusers' own quantizer mapping is decided: the tensor-subclass families
    quanto and bitsandbytes (its config cannot even be built without the library, so it is decided
    by its method names only) are refused by name; torchao by name on the block streamer only (its
    int8 weights are swapped whole by the other transports); the others are moved when their
    weights are plain tensors (GGUF and BFL verified above and in test_gguf_storage.py), and
    refused by their tensor type when not (next tests)."""
    methods = set(AUTO_QUANTIZER_MAPPING)
    assert {"bitsandbytes_4bit", "bitsandbytes_8bit", "torchao", "quanto", "gguf", "bfl"} <= methods
    refused = {m for m in methods if unmovable_quantization(m) is not None}
    assert refused == {"bitsandbytes_4bit", "bitsandbytes_8bit", "torchao", "quanto"}
    whole = {m for m in methods if unmovable_quantization(m, streamed=False) is not None}
    assert whole == {"bitsandbytes_4bit", "bitsandbytes_8bit", "quanto"}
    for method in ("bitsandbytes_4bit", "bitsandbytes_8bit"):
        assert "quantization state (absmax, scales)" in unmovable_quantization(method)
    for method in ("quanto", "optimum.quanto WeightQBytesTensor"):
        assert "inner tensors" in unmovable_quantization(method, streamed=False)
    for method, tensor_type in (("torchao", None), ("torchao Int8Tensor", "torchao.Int8Tensor")):
        assert "block streamer" in unmovable_quantization(method, tensor_type)
        assert unmovable_quantization(method, tensor_type, streamed=False) is None


def test_an_unverified_torchao_type_is_refused_by_its_type():
    """A torchao tensor type other than int8 weight-only's ``Int8Tensor`` is not verified on the
    engine's moves: refused by its type on every moving role, whatever the method says."""
    for method in ("torchao", "modelopt"):
        for streamed in (True, False):
            why = unmovable_quantization(method, "torchao.Float8Tensor", streamed=streamed)
            assert why.startswith("has torchao.Float8Tensor weights: a torchao tensor type")


def test_an_unknown_tensor_type_is_refused_by_its_type(tiny_transformer):
    """A weight of a tensor type the engine does not know (here diffusers' own
    `BFLQuantizedParameter`, a Parameter subclass carrying scales as attributes) is refused by
    its type whatever the method says, before anything is placed."""
    layer = tiny_transformer.blocks[0].attn1.to_q
    weight, scale = quantize_fp8r(layer.weight.detach())
    layer.weight = BFLQuantizedParameter(weight, "fp8r", scale)
    assert describe("transformer", tiny_transformer).quantization == "diffusers BFLQuantizedParameter"
    with pytest.raises(
        OffloadConfigError,
        match=r"transformer \(WanTransformer3DModel\) has "
        r"diffusers\.BFLQuantizedParameter weights: a tensor type the engine does not know",
    ):
        Engine().place(Components(transformer=tiny_transformer), OffloadConfig(mode="model", **BASE))
    assert leftovers(tiny_transformer) == []


@pytest.mark.parametrize("quantization", [None, "gguf Q8_0/Q4_K", "bfl", "fp8-weights", "sdnq"])
def test_movable_quantizations_pass(quantization):
    assert unmovable_quantization(quantization) is None


# -- BFL fp8r: diffusers' BFL quantizer loads fp8 weights with per-row fp32 scales as plain tensors
# (`BFLFP8RLinear`: a float8 Parameter and a ``weight_scale`` buffer), which every transport moves.
BFL_CONFIGS = {k: v for k, v in PLACEMENTS.items() if k != "none"}  # none is the reference


@pytest.fixture(scope="module")
def bfl_file(tiny_wan_dir, tmp_path_factory) -> Path:
    """The tiny Wan transformer as a BFL fp8r single file (original Wan keys), every block Linear
    quantized by diffusers' own ``quantize_fp8r``."""
    state = {}
    for key, value in comfy_wan_state_dict(tiny_wan_dir).items():
        if key.startswith("blocks.") and key.endswith(".weight") and value.ndim == 2:
            state[key], state[key.removesuffix("weight") + "weight_scale"] = quantize_fp8r(value)
        else:
            state[key] = value
    path = tmp_path_factory.mktemp("bfl") / "wan_fp8r.safetensors"
    save_file(state, str(path))
    return path


@pytest.fixture
def bfl_wan(tiny_wan_dir, bfl_file):
    pipe = load_wan(tiny_wan_dir)
    model = WanTransformer3DModel.from_single_file(
        str(bfl_file),
        config=str(tiny_wan_dir),
        subfolder="transformer",
        local_files_only=True,
        quantization_config=BFLQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32,
    )
    pipe.register_modules(transformer=model)
    return pipe


def test_bfl_fp8r_is_described_and_stored_in_fp8(bfl_wan):
    assert describe("transformer", bfl_wan.transformer).quantization == "bfl"
    layer = bfl_wan.transformer.blocks[0].attn1.to_q
    assert type(layer).__name__ == "BFLFP8RLinear" and layer.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("config", list(BFL_CONFIGS))
def test_bfl_fp8r_equals_resident_in_every_mode(bfl_wan, tiny_wan_dir, config):
    engine = Engine()
    engine.place(bfl_wan, OffloadConfig(mode="none", **BASE))
    expected = run_wan(bfl_wan)
    engine.release(bfl_wan)
    stored = {n: t.detach().clone() for n, t in bfl_wan.transformer.state_dict().items()}
    first, second = two_runs_placed(engine, bfl_wan, OffloadConfig(**BFL_CONFIGS[config], **BASE))
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert leftovers(bfl_wan.transformer) == []
    after = bfl_wan.transformer.state_dict()
    assert all(
        after[n].dtype == t.dtype and torch.equal(after[n].view(torch.uint8), t.view(torch.uint8))
        if t.dtype == torch.float8_e4m3fn
        else torch.equal(after[n], t)
        for n, t in stored.items()
    )
    # quantized, and within fp8r's error of the float32 model (decoded frames: measured 2.9e-5)
    reference = run_wan(load_wan(tiny_wan_dir))
    assert 0 < (first - reference).norm() / reference.norm() < 1e-3

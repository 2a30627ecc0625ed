"""Quantizers diffusers loads besides GGUF and the pack's fp8 table (SPEC §11): the engine places
what it can move and refuses the rest by name, before anything is placed.

- torchao int8 weight-only (diffusers' ``TorchAoConfig``, and torchao's own ``quantize_`` with no
  config): resident (mode none, or the never list) equals the unplaced quantized model bit for
  bit; every moving role is refused naming the component, the method and what to do, leaving
  nothing of ours. Why refused: rebinding ``param.data`` (what the transports do) does not carry a
  torchao tensor's inner data — shown below on torchao itself.
- bitsandbytes / optimum-quanto are not installed (bitsandbytes needs CUDA): only the decision
  is tested — quanto on a real diffusers ``QuantoConfig`` attached to a real tiny model,
  bitsandbytes on its method names (``BitsAndBytesConfig`` cannot be built without the library).
  Their real tensor types and resident runs are NOT covered here.
- every method in diffusers' quantizer mapping is decided: torchao, quanto and bitsandbytes are
  refused by name; any other is moved when its weights are plain tensors and refused by their
  type when a weight is a tensor type the engine does not know (a real diffusers subclass here).
- BFL fp8r (a real single file loaded by diffusers' BFL quantizer) rides every transport: each
  mode and preload policy equals the resident model bit for bit; the fp8 bytes come back as they
  were. BFL nvfp4 is not covered (same plain-tensor layout, not built here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import BFLQuantizationConfig, QuantoConfig, TorchAoConfig, WanTransformer3DModel
from diffusers.quantizers.auto import AUTO_QUANTIZER_MAPPING
from diffusers.quantizers.bfl.utils import BFLQuantizedParameter, quantize_fp8r
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.components import Components, describe
from diffusers_offload.offload_core.config import OffloadConfigError
from diffusers_offload.offload_core.guards import unmovable_quantization
from diffusers_offload.offload_core.state import leftovers
from fixtures.gguf_files import comfy_wan_state_dict
from fixtures.placements import PLACEMENTS
from fixtures.tiny_models import load_wan, run_wan
from safetensors.torch import save_file
from torchao.quantization import Int8WeightOnlyConfig, quantize_

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
RESIDENT = {"none": dict(mode="none"), "auto-never": dict(mode="auto", never="transformer")}
MOVING = {
    "auto": (dict(mode="auto"), "per-step"),
    "auto-keep-all": (dict(mode="auto", preload="100"), "per-step"),
    "model": (dict(mode="model"), "on-demand"),
    "leaf": (dict(mode="leaf"), "leaf"),
}


def _int8(model: torch.nn.Module) -> None:
    quantize_(model, Int8WeightOnlyConfig())


@pytest.fixture(params=["diffusers-config", "quantize_"])
def torchao_wan(request, tiny_wan_dir):
    """The tiny Wan with its transformer int8 weight-only: through diffusers' loader, or torchao's
    ``quantize_`` on the loaded model (no quantization_config at all)."""
    pipe = load_wan(tiny_wan_dir)
    if request.param == "diffusers-config":
        transformer = WanTransformer3DModel.from_pretrained(
            tiny_wan_dir / "transformer", torch_dtype=torch.float32,
            quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
        pipe.register_modules(transformer=transformer)
    else:
        _int8(pipe.transformer)
    assert type(pipe.transformer.blocks[0].attn1.to_q.weight).__module__.startswith("torchao")
    return pipe


def test_describe_names_torchao(torchao_wan):
    quantization = describe("transformer", torchao_wan.transformer).quantization
    assert quantization is not None and quantization.startswith("torchao")


@pytest.mark.parametrize("config", list(RESIDENT))
def test_torchao_resident_equals_the_unplaced_model(torchao_wan, config):
    expected = run_wan(torchao_wan)
    engine = Engine()
    report = engine.place(torchao_wan, OffloadConfig(**RESIDENT[config], **BASE))
    assert {c.name: c.role for c in report.components}["transformer"] == "resident"
    assert torch.equal(run_wan(torchao_wan), expected)
    engine.after_run(torchao_wan)
    assert torch.equal(run_wan(torchao_wan), expected)
    engine.release(torchao_wan)
    assert leftovers(torchao_wan.transformer) == []
    assert torch.equal(run_wan(torchao_wan), expected)


@pytest.mark.parametrize("config", list(MOVING))
def test_torchao_moving_roles_are_refused_by_name_leaving_nothing(torchao_wan, config):
    options, role = MOVING[config]
    expected = run_wan(torchao_wan)
    engine = Engine()
    with pytest.raises(OffloadConfigError) as refused:
        engine.place(torchao_wan, OffloadConfig(**options, **BASE))
    message = str(refused.value)
    assert message.startswith("transformer (WanTransformer3DModel) is quantized by torchao")
    assert f"the {role} role" in message
    assert "mode 'none'" in message and "never list" in message and "GGUF" in message
    for name, module in torchao_wan.components.items():
        if isinstance(module, torch.nn.Module):
            assert leftovers(module) == [], name
    assert engine.states(torchao_wan) == {}
    assert torch.equal(run_wan(torchao_wan), expected)


def test_a_refusal_leaves_an_earlier_resident_placement_as_it_was(torchao_wan):
    engine = Engine()
    engine.place(torchao_wan, OffloadConfig(mode="none", **BASE))
    before = {name: state.decision.role for name, state in engine.states(torchao_wan).items()}
    with pytest.raises(OffloadConfigError, match="transformer"):
        engine.place(torchao_wan, OffloadConfig(mode="model", **BASE))
    assert {name: state.decision.role for name, state in engine.states(torchao_wan).items()} == before
    engine.release(torchao_wan)
    assert leftovers(torchao_wan.transformer) == []


def test_rebinding_param_data_does_not_carry_torchao_inner_tensors():
    """The reason the refusal gives, checked on torchao itself: a layer whose weight's ``.data``
    is rebound to another int8 tensor keeps computing from its old inner data."""
    a, b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    _int8(a)
    _int8(b)
    x = torch.randn(2, 64)
    before = a(x)
    a.weight.data = b.weight.data
    assert not torch.equal(a(x), b(x))
    assert torch.equal(a(x), before)


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
    (torchao, quanto, bitsandbytes: its config cannot even be built without the library, so it
    is decided by its method names only) are refused by name; the others are moved when their
    weights are plain tensors (GGUF and BFL verified above and in test_gguf_storage.py), and
    refused by their tensor type when not (next test)."""
    methods = set(AUTO_QUANTIZER_MAPPING)
    assert {"bitsandbytes_4bit", "bitsandbytes_8bit", "torchao", "quanto", "gguf", "bfl"} <= methods
    refused = {m for m in methods if unmovable_quantization(m) is not None}
    assert refused == {"bitsandbytes_4bit", "bitsandbytes_8bit", "torchao", "quanto"}
    for method in ("bitsandbytes_4bit", "bitsandbytes_8bit"):
        assert "quantization state (absmax, scales)" in unmovable_quantization(method)
    for method in ("torchao", "quanto", "torchao Int8Tensor", "optimum.quanto WeightQBytesTensor"):
        assert "inner tensors" in unmovable_quantization(method)
    assert "inner tensors" in unmovable_quantization("modelopt", "torchao.Float8Tensor")


def test_an_unknown_tensor_type_is_refused_by_its_type(tiny_transformer):
    """A weight of a tensor type the engine does not know (here diffusers' own
    `BFLQuantizedParameter`, a Parameter subclass carrying scales as attributes) is refused by
    its type whatever the method says, before anything is placed."""
    layer = tiny_transformer.blocks[0].attn1.to_q
    weight, scale = quantize_fp8r(layer.weight.detach())
    layer.weight = BFLQuantizedParameter(weight, "fp8r", scale)
    assert describe("transformer", tiny_transformer).quantization == "diffusers BFLQuantizedParameter"
    with pytest.raises(OffloadConfigError, match=r"transformer \(WanTransformer3DModel\) has "
                       r"diffusers\.BFLQuantizedParameter weights: a tensor type the engine does not know"):
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
        str(bfl_file), config=str(tiny_wan_dir), subfolder="transformer", local_files_only=True,
        quantization_config=BFLQuantizationConfig(compute_dtype=torch.float32), torch_dtype=torch.float32)
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
    engine.place(bfl_wan, OffloadConfig(**BFL_CONFIGS[config], **BASE))
    first = run_wan(bfl_wan)
    engine.after_run(bfl_wan)
    second = run_wan(bfl_wan)
    engine.release(bfl_wan)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert leftovers(bfl_wan.transformer) == []
    after = bfl_wan.transformer.state_dict()
    assert all(after[n].dtype == t.dtype and torch.equal(after[n].view(torch.uint8), t.view(torch.uint8))
               if t.dtype == torch.float8_e4m3fn else torch.equal(after[n], t) for n, t in stored.items())
    # quantized, and within fp8r's error of the float32 model (decoded frames: measured 2.9e-5)
    reference = run_wan(load_wan(tiny_wan_dir))
    assert 0 < (first - reference).norm() / reference.norm() < 1e-3

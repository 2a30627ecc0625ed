"""torchao int8 weight-only components on the engine's whole-module transports (SPEC §11).

A torchao weight is a tensor subclass (``Int8Tensor``) whose data lives in inner tensors
(``qdata``, ``scale``, ``zero_point``): rebinding ``param.data`` moves only its wrapper, so the
engine swaps the whole tensor into the same Parameter (``torch.utils.swap_tensors``).

- resident (mode none, the never list), on demand (mode model) and leaf groups (mode leaf) equal
  the resident model bit for bit; after a release every weight is the same Parameter object, of
  the same type, over the same inner storages with the same values;
- the report and the transports count the inner tensors' bytes, not numel times the outer dtype;
- the on-demand transport really moves the inner tensors and really puts them back: on the CPU
  the onload and offload devices are one, so it is driven here with the ``meta`` device as the
  onload device (every inner tensor there while loaded; back on the very same CPU storages after,
  which a ``param.data`` rebind would not do: the last test shows why on torchao itself);
- the block streamer (mode auto's denoiser, an auto text encoder's layer stream) is still
  refused, by name, saying which modes carry torchao, leaving nothing of ours behind.
Both ways of quantizing are covered: diffusers' ``TorchAoConfig`` and torchao's own ``quantize_``.
Not covered here (no GPU): the pinned paths (on-demand pinning, leaf groups with streams).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import TorchAoConfig, WanTransformer3DModel
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.components import describe
from diffusers_offload.offload_core.config import OffloadConfigError
from diffusers_offload.offload_core.state import leftovers
from diffusers_offload.offload_core.transport.base import TransportContext
from diffusers_offload.offload_core.transport.leaf import LeafGroupTransport
from diffusers_offload.offload_core.transport.on_demand import OnDemandTransport
from fixtures.tiny_models import load_wan, run_wan
from torchao.quantization import Int8WeightOnlyConfig, quantize_

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
RIDES = {
    "none": (dict(mode="none"), "resident"),
    "auto-never": (dict(mode="auto", never="transformer"), "resident"),
    "model": (dict(mode="model"), "on-demand"),
    "leaf": (dict(mode="leaf"), "leaf"),
}
STREAMED = {"auto": dict(mode="auto"), "auto-keep-all": dict(mode="auto", preload="100")}
META = torch.device("meta")


def _int8(model: torch.nn.Module) -> None:
    quantize_(model, Int8WeightOnlyConfig())


@pytest.fixture(params=["diffusers-config", "quantize_"])
def torchao_wan(request, tiny_wan_dir):
    """The tiny Wan with its transformer int8 weight-only: through diffusers' loader, or torchao's
    ``quantize_`` on the loaded model (no quantization_config at all)."""
    pipe = load_wan(tiny_wan_dir)
    if request.param == "diffusers-config":
        transformer = WanTransformer3DModel.from_pretrained(
            tiny_wan_dir / "transformer",
            torch_dtype=torch.float32,
            quantization_config=TorchAoConfig(Int8WeightOnlyConfig()),
        )
        pipe.register_modules(transformer=transformer)
    else:
        _int8(pipe.transformer)
    assert type(pipe.transformer.blocks[0].attn1.to_q.weight).__name__ == "Int8Tensor"
    return pipe


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``t``'s data, read from torchao's own flatten protocol."""
    if type(t).__name__ != "Int8Tensor":
        return [t]
    names, _ctx = t.__tensor_flatten__()
    return [getattr(t, n) for n in names if getattr(t, n) is not None]


def stored_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    return sum(i.numel() * i.element_size() for t in tensors for i in _inner(t))


Snapshot = dict[str, tuple[torch.Tensor, type, list[tuple[int, torch.device, torch.Tensor]]]]


def snapshot(model: torch.nn.Module) -> Snapshot:
    """name -> (the Parameter object, its type, each inner tensor's (pointer, device, copy))."""
    return {
        n: (p, type(p), [(i.data_ptr(), i.device, i.detach().clone()) for i in _inner(p)])
        for n, p in model.named_parameters()
    }


def assert_as_before(model: torch.nn.Module, before: Snapshot) -> None:
    """Every weight is the same object, same type, over the same storages with the same values."""
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, cls, inner) in before.items():
        p = after[name]
        assert p is param and type(p) is cls, name
        now = _inner(p)
        assert len(now) == len(inner), name
        for t, (ptr, device, values) in zip(now, inner, strict=True):
            assert t.device == device and t.data_ptr() == ptr and torch.equal(t, values), name


@pytest.fixture
def torchao_text_encoder(tiny_wan_dir):
    """The tiny Wan with its (transformers) UMT5 text encoder int8 weight-only."""
    pipe = load_wan(tiny_wan_dir)
    _int8(pipe.text_encoder)
    return pipe


def resident_output(pipe) -> torch.Tensor:
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="none", **BASE))
    out = run_wan(pipe)
    engine.release(pipe)
    return out


def test_describe_names_torchao_and_counts_inner_bytes(torchao_wan):
    model = torchao_wan.transformer
    info = describe("transformer", model)
    assert info.quantization is not None and info.quantization.startswith("torchao")
    assert info.nbytes == stored_bytes(model)
    outer = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert info.nbytes < outer, "an int8 weight reports float32: its outer size is not what it stores"


@pytest.mark.parametrize("config", list(RIDES))
def test_torchao_rides_each_whole_module_mode_bit_exact(torchao_wan, config):
    options, role = RIDES[config]
    expected = resident_output(torchao_wan)
    before = snapshot(torchao_wan.transformer)
    engine = Engine()
    report = engine.place(torchao_wan, OffloadConfig(**options, **BASE))
    component = report.component("transformer")
    assert component.role == role
    assert component.nbytes == stored_bytes(torchao_wan.transformer)
    first = run_wan(torchao_wan)
    engine.after_run(torchao_wan)
    second = run_wan(torchao_wan)
    engine.release(torchao_wan)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert leftovers(torchao_wan.transformer) == []
    assert_as_before(torchao_wan.transformer, before)
    assert torch.equal(run_wan(torchao_wan), expected)


@pytest.mark.parametrize("config", ["model", "leaf"])
def test_layers_compute_from_their_own_int8_weights(torchao_wan, config, monkeypatch):
    """What each quantized Linear computes from while placed: the module's own Parameter object,
    still an ``Int8Tensor`` with int8 ``qdata`` (nothing dequantized or copied around it)."""
    expected = {id(p) for p in torchao_wan.transformer.parameters() if type(p).__name__ == "Int8Tensor"}
    seen: set[int] = set()
    real = torch.nn.functional.linear

    def watching(x, weight, bias=None):
        if type(weight).__name__ == "Int8Tensor":
            assert id(weight) in expected, "a layer computes from another tensor"
            assert weight.qdata.dtype == torch.int8 and weight.qdata.device.type == "cpu"
            seen.add(id(weight))
        return real(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", watching)
    engine = Engine()
    engine.place(torchao_wan, OffloadConfig(**RIDES[config][0], **BASE))
    run_wan(torchao_wan, num_inference_steps=1)
    engine.release(torchao_wan)
    assert seen == expected, "every int8 layer ran"


def test_on_demand_moves_the_inner_tensors_and_puts_the_same_ones_back(torchao_text_encoder):
    """Driven with ``meta`` as the onload device (a real move on a CPU-only machine), on a real
    layer of the quantized UMT5 text encoder whose weights are all int8 (its gated FFN; a plain
    weight cannot visit ``meta`` and come back by ``.data``): entering moves every inner tensor
    there, counted by its bytes; leaving puts every Parameter back on its own CPU storages. A
    ``param.data`` rebind would leave the inner tensors on ``meta`` and this test would fail."""
    ffn = torchao_text_encoder.text_encoder.encoder.block[0].layer[-1].DenseReluDense
    assert {type(p).__name__ for p in ffn.parameters()} == {"Int8Tensor"}
    x = torch.randn(1, 4, ffn.wi_0.in_features)
    expected = ffn(x)
    before = snapshot(ffn)
    transport = OnDemandTransport(TransportContext(onload_device=META))
    transport.apply(ffn)
    assert transport.run_bytes() == stored_bytes(ffn)
    out = ffn(x.to(META))  # the forward entry moves it in; it stays until sent home
    assert out.device == META and out.shape == expected.shape
    for name, p in ffn.named_parameters():
        assert p is before[name][0] and type(p) is before[name][1], name
        assert all(i.device == META for i in _inner(p)), name
    assert transport.device_bytes() == stored_bytes(ffn) > 0
    masters = transport.masters()
    assert masters.keys() == {id(p) for p in ffn.parameters()}
    assert all(i.device.type == "cpu" for ts in masters.values() for t in ts for i in _inner(t))
    assert transport.offload_idle()
    assert transport.device_bytes() == 0
    assert_as_before(ffn, before)
    transport.onload()  # a second visit moves the same weights again
    assert all(i.device == META for p in ffn.parameters() for i in _inner(p))
    transport.remove(ffn)
    assert leftovers(ffn) == []
    assert_as_before(ffn, before)
    assert torch.equal(ffn(x), expected)


def test_leaf_groups_count_the_largest_leaf_by_its_inner_bytes(torchao_wan):
    model = torchao_wan.transformer
    transport = LeafGroupTransport(TransportContext(onload_device=torch.device("cpu")))
    transport.apply(model)
    leaves = [m for m in model.modules() if not list(m.children())]
    assert transport.run_bytes() == max(stored_bytes(m) for m in leaves)
    transport.remove(model)
    assert leftovers(model) == []


@pytest.mark.parametrize("config", list(STREAMED))
def test_the_block_streamer_is_refused_naming_the_modes_that_work(torchao_wan, config):
    expected = run_wan(torchao_wan)
    engine = Engine()
    with pytest.raises(OffloadConfigError) as refused:
        engine.place(torchao_wan, OffloadConfig(**STREAMED[config], **BASE))
    message = str(refused.value)
    assert message.startswith("transformer (WanTransformer3DModel) is quantized by torchao")
    assert "block streamer" in message and "the per-step role" in message
    assert "mode 'model'" in message and "mode 'leaf'" in message and "mode 'none'" in message
    assert "'transformer' to the never list" in message
    for name, module in torchao_wan.components.items():
        if isinstance(module, torch.nn.Module):
            assert leftovers(module) == [], name
    assert engine.states(torchao_wan) == {}
    assert torch.equal(run_wan(torchao_wan), expected)


@pytest.mark.parametrize("config", ["model", "leaf"])
def test_a_torchao_text_encoder_rides_model_and_leaf(torchao_text_encoder, config):
    pipe = torchao_text_encoder
    expected = resident_output(pipe)
    before = snapshot(pipe.text_encoder)
    engine = Engine()
    report = engine.place(pipe, OffloadConfig(mode=config, **BASE))
    assert report.component("text_encoder").nbytes == stored_bytes(pipe.text_encoder)
    out = run_wan(pipe)
    engine.release(pipe)
    assert torch.equal(out, expected)
    assert leftovers(pipe.text_encoder) == []
    assert_as_before(pipe.text_encoder, before)


def test_an_auto_text_encoder_layer_stream_is_refused(torchao_text_encoder):
    with pytest.raises(OffloadConfigError) as refused:
        Engine().place(torchao_text_encoder, OffloadConfig(mode="auto", **BASE))
    message = str(refused.value)
    assert message.startswith("text_encoder (UMT5EncoderModel) is quantized by torchao Int8Tensor")
    assert "the leaf (layer stream) role" in message and "mode 'leaf'" in message
    assert leftovers(torchao_text_encoder.text_encoder) == []


def test_rebinding_param_data_does_not_carry_torchao_inner_tensors():
    """Why the engine swaps: a layer whose weight's ``.data`` is rebound to another int8 tensor
    keeps computing from its old inner data (checked on torchao itself)."""
    a, b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    _int8(a)
    _int8(b)
    x = torch.randn(2, 64)
    before = a(x)
    a.weight.data = b.weight.data
    assert not torch.equal(a(x), b(x))
    assert torch.equal(a(x), before)

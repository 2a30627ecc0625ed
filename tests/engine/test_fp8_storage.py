"""fp8 storage with bf16 compute on every transport: outputs equal a bf16 model holding the
dequantised weights (``fp8.to(bf16) * scale``), bit for bit, in every mode and preload policy;
what the streamer moves and keeps is fp8 bytes; a release leaves the fp8 weights as they were."""

import copy

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import mark_fp8, store_fp8
from diffusers_offload.offload_core.state import leftovers
from diffusers_offload.offload_core.transport.prefetch import Prefetcher
from fixtures.placements import PLACEMENTS, grant_pinned_masters
from fixtures.quantized import placed_twice_equals, scaled_fp8, streamed_in_one_step
from fixtures.tiny_models import load_bf16, run_wan

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
CONFIGS = PLACEMENTS


def _dequantised_twin(pipe, scales: dict[str, torch.Tensor]):
    """The same pipeline with each fp8 weight replaced by ``fp8.to(bf16) * scale.to(bf16)`` (the
    independent reference: comfy-kitchen's dequantisation written out from the file's scales,
    not the pack's code)."""
    twin = copy.copy(pipe)
    transformer = copy.deepcopy(pipe.transformer)
    originals = dict(pipe.transformer.named_modules())
    for name, layer in transformer.named_modules():
        w = originals[name].weight if isinstance(layer, torch.nn.Linear) else None
        if w is not None and w.dtype == torch.float8_e4m3fn:
            value = w.data.to(torch.bfloat16)
            layer.weight.data = value * scales[name].to(torch.bfloat16) if name in scales else value
    vars(transformer).pop("_diffusers_offload_fp8", None)
    twin.register_modules(transformer=transformer)
    return twin


@pytest.fixture(params=["plain", "scaled"])
def fp8_wan(request, tiny_wan_dir):
    """(the tiny Wan with its transformer in fp8, the file-side scales by layer)"""
    pipe = load_bf16(tiny_wan_dir)
    scales = {}
    if request.param == "plain":
        store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16)
    else:
        scales = scaled_fp8(pipe.transformer)
        mark_fp8(pipe.transformer, torch.bfloat16, scales)
    return pipe, scales


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp8_output_equals_the_dequantised_bf16_model_in_every_mode(fp8_wan, config):
    fp8_wan, scales = fp8_wan
    placed_twice_equals(fp8_wan, OffloadConfig(**CONFIGS[config], **BASE), run_wan(_dequantised_twin(fp8_wan, scales)))


@pytest.mark.parametrize("config", ["auto-keep-some", "auto-keep-none"])
def test_fp8_units_with_packets_equal_the_dequantised_bf16_model(fp8_wan, config, monkeypatch):
    """Pinned masters (as on a CUDA device): a unit's fp8 weights lie first, cast as one region,
    its small tensors last, in one packet; the same output."""
    grant_pinned_masters(monkeypatch)
    fp8_wan, scales = fp8_wan
    placed_twice_equals(fp8_wan, OffloadConfig(**CONFIGS[config], **BASE), run_wan(_dequantised_twin(fp8_wan, scales)))


def test_scales_are_applied(tiny_wan_dir):
    """The scaled file's output differs from the unscaled fp8 values (what diffusers'
    from_single_file silently loads): a pack that dropped the scales fails here."""
    pipe = load_bf16(tiny_wan_dir)
    scales = scaled_fp8(pipe.transformer)
    mark_fp8(pipe.transformer, torch.bfloat16, scales)
    expected = run_wan(_dequantised_twin(pipe, scales))
    unscaled = _dequantised_twin(pipe, {})
    for name, layer in unscaled.transformer.named_modules():
        w = dict(pipe.transformer.named_modules())[name]
        if isinstance(layer, torch.nn.Linear) and w.weight.dtype == torch.float8_e4m3fn:
            layer.weight.data = w.weight.data.to(torch.bfloat16)
    assert not torch.allclose(run_wan(unscaled), expected)
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="auto", **BASE))
    assert torch.equal(run_wan(pipe), expected)
    engine.release(pipe)


def test_streamer_moves_and_keeps_fp8_bytes(tiny_wan_dir, monkeypatch):
    pipe = load_bf16(tiny_wan_dir)
    model = pipe.transformer
    bf16_blocks = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
    store_fp8(model, torch.float8_e4m3fn, torch.bfloat16)
    fp8_blocks = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
    assert fp8_blocks < 0.6 * bf16_blocks
    moved, _dtypes, report, engine = streamed_in_one_step(pipe, monkeypatch, **BASE)
    forwards = 2  # one step, classifier-free guidance: two transformer forwards
    assert sum(moved) == forwards * fp8_blocks
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    assert report.component("transformer").nbytes == sum(t.numel() * t.element_size() for t in tensors)
    engine.release(pipe)


@pytest.mark.parametrize("masters", ["pageable", "pinned"])
def test_the_count_of_copied_bytes_is_what_the_copies_moved(tiny_wan_dir, monkeypatch, masters):
    """The streamer's count of copied bytes (what the benches divide by the H2D bandwidth for their
    bound) is the bytes every copy of the transformer's streamer moved, kept pieces included, a
    unit's packet whole where its masters are pinned."""
    if masters == "pinned":
        grant_pinned_masters(monkeypatch)
    pipe = load_bf16(tiny_wan_dir)
    store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16)
    moved: dict[int, int] = {}  # by prefetcher (a streamed text encoder copies too)
    real_copy = Prefetcher.copy

    def counting(self, pairs, pinned, after):
        pairs = list(pairs)
        moved[id(self)] = moved.get(id(self), 0) + sum(src.numel() * src.element_size() for _dst, src in pairs)
        return real_copy(self, pairs, pinned, after)

    monkeypatch.setattr(Prefetcher, "copy", counting)
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="auto", **BASE))
    transport = engine.states(pipe)["transformer"].transport
    transport.events.unsubscribe("preload")  # (no planner: the test sets what is kept)
    transport.set_resident(transport.pieces_of({0}))  # block 0 copied once, the others every forward
    assert all(u.packed >= 2 for u in transport.units) == (masters == "pinned")
    run_wan(pipe, num_inference_steps=1)
    engine.after_run(pipe)
    assert transport.prefetch.copied == moved[id(transport.prefetch)] > 0
    engine.release(pipe)


def test_a_scale_that_does_not_match_its_weight_is_refused(tiny_wan_dir):
    pipe = load_bf16(tiny_wan_dir)
    scales = scaled_fp8(pipe.transformer)
    name = next(iter(scales))
    scales[name] = torch.ones(3)
    with pytest.raises(ValueError, match=f"the scale of {name} has shape \\(3,\\)"):
        mark_fp8(pipe.transformer, torch.bfloat16, scales)
    with pytest.raises(ValueError, match="fp8 weights compute in bf16, fp16 or fp32"):
        store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.int8)


def test_diffusers_layerwise_casting_on_an_fp8_layer_is_refused_by_name_and_kept(tiny_wan_dir):
    """The pack's dequantising hook sits under diffusers' ``layerwise_casting`` name (so that
    ``get_parameter_dtype`` reads the compute dtype): a user's own cast there is refused by the
    layer's name before anything is placed, and stays on the layer."""
    from diffusers.hooks.layerwise_casting import apply_layerwise_casting

    pipe = load_bf16(tiny_wan_dir)
    store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16)
    layer = pipe.transformer.blocks[0].attn1.to_q
    apply_layerwise_casting(layer, torch.float8_e4m3fn, torch.bfloat16)
    engine = Engine()
    with pytest.raises(ValueError, match=r"transformer\.blocks\.0\.attn1\.to_q carries diffusers' layerwise casting"):
        engine.place(pipe, OffloadConfig(mode="none", **BASE))
    assert engine.states(pipe) == {} and leftovers(pipe.transformer) == []
    assert layer._diffusers_hook.get_hook("layerwise_casting") is not None  # the user's hook stays


def test_an_fp8_model_placed_again_keeps_its_own_casting_hooks(fp8_wan):
    """A second place (a new config, as each Generate does) meets the pack's own hooks under the
    layerwise-casting name: not refused, and the output stays the dequantised model's."""
    fp8_wan, scales = fp8_wan
    expected = run_wan(_dequantised_twin(fp8_wan, scales))
    engine = Engine()
    engine.place(fp8_wan, OffloadConfig(mode="none", **BASE))
    engine.place(fp8_wan, OffloadConfig(mode="auto", **BASE))
    try:
        assert torch.equal(run_wan(fp8_wan), expected)
    finally:
        engine.release(fp8_wan)
    assert leftovers(fp8_wan.transformer) == []

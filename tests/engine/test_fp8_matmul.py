"""fp8 matmuls (ComfyUI's ``fp8_e4m3fn_fast``): every fp8 Linear computes from its stored bytes as
comfy-kitchen's fp8 linear does (the dispatch ComfyUI's layers call: an unscaled weight's input
clamped to ±448 and cast at scale 1, a scaled file's input quantised per tensor), bit for bit, in
every mode and preload policy; nothing is cast, so what moves and stays is fp8 bytes; a release
leaves the weights as they were; LoRA stays unfused; other quantizers are left alone."""

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import store_fp8
from diffusers_offload.offload_core.lora import LoraSpec, activate
from diffusers_offload.offload_core.state import LORA_HOOK, leftovers
from fixtures.fp8_matmul import FP8, REL_L2, kitchen_twin, wide_transformer, wide_wan
from fixtures.placements import PLACEMENTS
from fixtures.quantized import dequantised_twin, placed_twice_equals, streamed_in_one_step
from fixtures.tiny_loras import wan_lora
from fixtures.tiny_models import load_wan, run_wan

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


@pytest.mark.parametrize("kind", ["plain", "scaled", "static"])
@pytest.mark.parametrize("config", list(PLACEMENTS))
def test_fp8_matmul_output_is_comfy_kitchens_in_every_mode(tiny_wan_dir, config, kind):
    """(static: a file's static input scales, as ComfyUI's quantized layers use them.)"""
    pipe = wide_wan(tiny_wan_dir, scaled=kind == "scaled", static=kind == "static")
    placed_twice_equals(pipe, OffloadConfig(**PLACEMENTS[config], **BASE), run_wan(kitchen_twin(pipe)))


def test_static_input_scales_change_the_output(tiny_wan_dir):
    """The same scaled weights with a file's static input scales and without (each input's own
    largest value): the outputs differ, so the static rows above test the static path."""
    outputs = []
    for static in (False, True):
        pipe = wide_wan(tiny_wan_dir, scaled=True, static=static)
        engine = Engine()
        engine.place(pipe, OffloadConfig(mode="auto", **BASE))
        outputs.append(run_wan(pipe))
        engine.release(pipe)
    assert not torch.equal(*outputs)


def test_fp8_matmul_is_not_the_dequantised_math(tiny_wan_dir):
    """The inputs are rounded to fp8: the output differs from fp8 storage with bf16 compute, and
    stays within fp8's error of it (what makes the comparison above not vacuous)."""
    pipe = wide_wan(tiny_wan_dir)
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="auto", **BASE))
    fast = run_wan(pipe)
    engine.release(pipe)
    pipe.register_modules(transformer=dequantised_twin(pipe.transformer))
    bf16 = run_wan(pipe)
    assert not torch.equal(fast, bf16)
    assert (fast - bf16).norm() < REL_L2 * bf16.norm()


def test_the_streamer_casts_nothing_and_moves_fp8_bytes(tiny_wan_dir, monkeypatch):
    pipe = wide_wan(tiny_wan_dir)
    model = pipe.transformer
    fp8_blocks = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
    moved, dtypes, report, engine = streamed_in_one_step(pipe, monkeypatch, **BASE)
    assert "[fp8-weights (fp8 matmul)]" in report.text()
    transport = engine.states(pipe)["transformer"].transport
    assert transport.self_cast() == set() and all(u.cast is None for u in transport.units)
    assert FP8 in dtypes and sum(moved) == 2 * fp8_blocks  # one step, two forwards (guidance)
    engine.release(pipe)


def test_fp8_matmul_takes_e4m3fn_only(tiny_wan_dir):
    pipe = load_wan(tiny_wan_dir)
    pipe.transformer.to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp8 matmuls take float8_e4m3fn weights, not float8_e5m2"):
        store_fp8(pipe.transformer, torch.float8_e5m2, torch.bfloat16, matmul=True)


def test_a_lora_on_fp8_matmul_layers_is_unfused_and_comes_off_bit_exactly(tiny_wan_dir, tmp_path):
    pipe = wide_wan(tiny_wan_dir)
    lora = LoraSpec(str(wan_lora(wide_transformer(), tmp_path, seed=3)))
    stored = {n: p.detach().view(torch.uint8).clone() for n, p in pipe.transformer.named_parameters()
              if p.dtype == FP8}
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="auto", **BASE))
    base = run_wan(pipe)
    engine.after_run(pipe)
    activate(pipe, [lora])
    with_lora = run_wan(pipe)
    engine.after_run(pipe)
    details = engine.report(pipe).component("transformer").details["lora"]
    assert details["path"] == "unfused" and set(details["unfused"].values()) == {"fp8"}
    assert not torch.equal(with_lora, base)
    activate(pipe, [])
    assert torch.equal(run_wan(pipe), base)
    engine.after_run(pipe)
    engine.release(pipe)
    assert leftovers(pipe.transformer) == []
    assert not any(LORA_HOOK in getattr(vars(m).get("_diffusers_hook"), "hooks", {})
                   for m in pipe.transformer.modules())
    assert all(torch.equal(pipe.transformer.get_parameter(n).view(torch.uint8), b) for n, b in stored.items())


def test_a_model_another_quantizer_made_is_left_as_it_is(tiny_wan_dir, tmp_path):
    """The single-file loader's fp8_matmul on a GGUF file: nothing stored, no table, bytes unchanged."""
    from diffusers import GGUFQuantizationConfig, WanTransformer3DModel
    from diffusers_offload.offload_core.formats.fp8 import table_of
    from fixtures.gguf_files import write_wan_gguf

    file = write_wan_gguf(tiny_wan_dir, tmp_path / "wan-Q8_0.gguf", "Q8_0")
    model = WanTransformer3DModel.from_single_file(
        str(file), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
        config=str(tiny_wan_dir), subfolder="transformer", torch_dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert store_fp8(model, FP8, torch.bfloat16, matmul=True) is None and table_of(model) is None
    assert all(p.dtype == before[n].dtype and torch.equal(p, before[n]) for n, p in model.named_parameters())

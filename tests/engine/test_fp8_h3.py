"""MiniMax-H3's transformer stored in fp8 (the loader's fp8 weight dtype): it runs, in mode none
and streamed, equal to a bf16 twin holding the dequantised weights. H3 is the model that needs
two things a Wan does not: its ``_keep_in_fp32_modules`` (``time_embedder``, ``audio_proj_in``)
stay out of fp8, as diffusers' layerwise casting leaves them; and it casts inputs to
``get_parameter_dtype(layer)``, which must read the compute dtype, not the stored fp8."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.modeling_utils import get_parameter_dtype
from diffusers.modular_pipelines import ModularPipeline
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import is_fp8, store_fp8
from diffusers_offload.offload_core.state import leftovers
from fixtures.quantized import dequantised_twin

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


def _load_bf16(path) -> ModularPipeline:
    pipe = ModularPipeline.from_pretrained(path, workflow="t2va")
    pipe.load_components(dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe: ModularPipeline) -> tuple[torch.Tensor, torch.Tensor]:
    from fixtures.tiny_models import run_h3

    out = run_h3(pipe)
    return out.video, out.audio


@pytest.fixture(scope="module")
def fp8_h3(tiny_h3_dir):
    """(the tiny H3 in bf16 with its transformer stored in fp8, the bf16 outputs of its twin)"""
    pipe = _load_bf16(tiny_h3_dir)
    store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16)
    fp8_transformer = pipe.transformer
    pipe.update_components(transformer=dequantised_twin(fp8_transformer))
    expected = _run(pipe)
    pipe.update_components(transformer=fp8_transformer)
    return pipe, expected


def test_keep_in_fp32_modules_are_not_stored_in_fp8(fp8_h3):
    pipe, _ = fp8_h3
    keep = pipe.transformer._keep_in_fp32_modules
    assert keep, "the tiny H3 declares modules kept in fp32"
    stored = [n for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear) and is_fp8(m.weight)]
    assert stored, "the blocks' Linear weights are fp8"
    assert not [n for n in stored if any(k in n for k in keep)], stored


@pytest.mark.parametrize("config", [dict(mode="none"), dict(mode="auto"), dict(mode="auto", preload="100")],
                         ids=["none", "auto", "auto-keep-all"])
def test_h3_in_fp8_runs_equal_to_its_dequantised_twin(fp8_h3, config):
    pipe, (video, audio) = fp8_h3
    engine = Engine()
    engine.place(pipe, OffloadConfig(**config, **BASE))
    try:
        # H3 casts the text states to this before its context embedder (fp8 there would fail)
        assert get_parameter_dtype(pipe.transformer.context_embedder) == torch.bfloat16
        got_video, got_audio = _run(pipe)
    finally:
        engine.release(pipe)
    assert torch.equal(got_video, video) and torch.equal(got_audio, audio)
    assert leftovers(pipe.transformer) == []
    assert any(is_fp8(m.weight) for m in pipe.transformer.modules() if isinstance(m, torch.nn.Linear))  # still fp8


def test_h3_with_fp8_matmuls_is_the_same_in_mode_none_and_streamed(tiny_h3_dir, monkeypatch):
    """The loader's ``fp8_e4m3fn_fast`` on H3: its fp8 Linears run ``_scaled_mm`` (counted), the
    input casts still read the compute dtype, and streaming gives mode none's bits."""
    pipe = _load_bf16(tiny_h3_dir)
    store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16, matmul=True)
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    outputs = []
    for config in (dict(mode="none"), dict(mode="auto")):
        engine = Engine()
        engine.place(pipe, OffloadConfig(**config, **BASE))
        try:
            assert get_parameter_dtype(pipe.transformer.context_embedder) == torch.bfloat16
            outputs.append(_run(pipe))
        finally:
            engine.release(pipe)
    assert calls, "no fp8 matmul ran"
    (video, audio), (got_video, got_audio) = outputs
    assert torch.isfinite(video).all() and torch.equal(got_video, video) and torch.equal(got_audio, audio)
    assert leftovers(pipe.transformer) == []

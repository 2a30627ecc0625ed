"""The loader's fp8 weight dtype on every family the pack runs: each pipeline's denoisers stored in
fp8 (`store_fp8` on each denoiser, bf16 compute) run, placed by the engine, to the output of the same
pipeline holding the dequantised bf16 weights (no engine code in the reference). MiniMax-H3 has
its own file (test_fp8_h3.py); the Wan 2.1 T2V one is test_fp8_storage.py."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.components import denoisers
from diffusers_offload.offload_core.formats.fp8 import store_fp8
from diffusers_offload.offload_core.state import leftovers
from fixtures.quantized import dequantised_twin
from fixtures.tiny_models import run_flux, run_ltx2
from fixtures.tiny_wan_families import run_wan_family

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
FAMILIES = {  # name: (how its folder is found, how it runs)
    "flux": ("tiny_flux_dir", run_flux),
    "ltx2": ("tiny_ltx2_dir", run_ltx2),
    "wan_i2v": ("wan_i2v", run_wan_family),
    "wan22_ti2v": ("wan22_ti2v", run_wan_family),
    "wan22_a14b": ("wan22_a14b", run_wan_family),
}


def _outputs(out) -> tuple[torch.Tensor, ...]:
    """A run's tensors: Flux/Wan frames, or LTX-2's (video, audio)."""
    outs = out if isinstance(out, tuple) else (out,)
    assert all(isinstance(t, torch.Tensor) for t in outs), [type(t) for t in outs]
    return outs


@pytest.fixture(params=list(FAMILIES))
def fp8_family(request, tiny_wan_family):
    """(pipeline in bf16 with its denoisers in fp8, its runner, the dequantised twin's outputs)"""
    where, run = FAMILIES[request.param]
    folder = request.getfixturevalue(where) if where.startswith("tiny_") else tiny_wan_family(where)
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    names = [n for n, m in denoisers(pipe).items() if store_fp8(m, torch.float8_e4m3fn, torch.bfloat16) is not None]
    assert names, "the pipeline has a denoiser"
    stored = {name: getattr(pipe, name) for name in names}
    pipe.register_modules(**{name: dequantised_twin(m) for name, m in stored.items()})
    expected = _outputs(run(pipe))
    pipe.register_modules(**stored)
    return pipe, run, expected


@pytest.mark.parametrize("config", [dict(mode="none"), dict(mode="auto")], ids=["none", "auto"])
def test_fp8_denoisers_run_equal_to_their_dequantised_twins(fp8_family, config):
    pipe, run, expected = fp8_family
    engine = Engine()
    engine.place(pipe, OffloadConfig(**config, **BASE))
    try:
        got = _outputs(run(pipe))
    finally:
        engine.release(pipe)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert all(leftovers(m) == [] for m in (getattr(pipe, n) for n in pipe.components) if isinstance(m, torch.nn.Module))

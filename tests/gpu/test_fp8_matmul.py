"""fp8 matmuls on a CUDA device (sm_89 or newer): the tiny wide Wan's fp8 Linears run
``_scaled_mm`` eagerly and inside the streamer's CUDA graphs, with the same bits either way, with
every block kept and with a plan that streams; the output differs from bf16 compute by fp8's error
only. Skipped without CUDA (CI): run on the GPU machine (bench/gpu_batch.sh row ``gputests``)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from fixtures.fp8_matmul import REL_L2, wide_wan
from fixtures.graph_runs import keep_first_after, placed_runs

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="fp8 matmuls need a CUDA device of sm_89 or newer")
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000")


@pytest.mark.parametrize("static", [False, True], ids=["unscaled", "static input scales"])
@pytest.mark.parametrize("streams", [False, True], ids=["all kept", "block 0 kept"])
def test_fp8_matmuls_graphed_equal_eager(tiny_wan_dir, monkeypatch, streams, static) -> None:
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(args[0].device.type)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)

    def runs(pipe, config: OffloadConfig, count: int = 3):
        return placed_runs(pipe, config, count, keep_first_after([]) if streams else None)

    eager, off = runs(wide_wan(tiny_wan_dir, static=static), OffloadConfig(**BASE, cuda_graphs=False))
    assert calls and set(calls) == {"cuda"}
    graphed, on = runs(wide_wan(tiny_wan_dir, static=static), OffloadConfig(**BASE))
    assert off["graphs"] == 0 and on["graphs"] > 0 and on["graphs_refused"] == 0
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))
    if static:  # (the fixture's static scales clamp large inputs: no closeness to bf16 to check)
        return
    bf16, _ = runs(wide_wan(tiny_wan_dir, matmul=False), OffloadConfig(**BASE), 1)
    assert not torch.equal(eager[0], bf16[0])
    assert (eager[0] - bf16[0]).norm() < REL_L2 * bf16[0].norm()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaled", [False, True], ids=["scale 1", "scaled"])
def test_the_fused_quantise_gives_the_bits_of_clamp_and_cast(dtype, scaled) -> None:
    """`fp8_kernel.quantized` (one pass) against ``(x * inv).clamp(-448, 448).to(fp8)`` by torch, on
    activations that run past fp8's range, and rows of zeros."""
    from diffusers_offload.offload_core.transport import fp8_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1000, 5120, generator=g, device="cuda") * 300).to(dtype)
    x[:7] = 0
    inv = (torch.tensor(0.37, device="cuda")).to(dtype) if scaled else None
    fused = fp8_kernel.quantized(x, inv)
    assert fused is not None and fused.dtype == torch.float8_e4m3fn
    reference = (x if inv is None else x * inv).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(fused.view(torch.uint8), reference.view(torch.uint8))

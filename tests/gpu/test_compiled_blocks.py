"""Compiled blocks (``compile_blocks``) on a CUDA device, compiled by inductor: every block kept
or streamed whole runs its compiled forward, graphed or not the outputs are the same bits, and
they are within the compiler's rounding of the uncompiled outputs; the fp8 blocks held as compute
values run compiled too. Run on the GPU machine (bench/gpu_batch.sh row ``gputests``)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from fixtures.graph_runs import keep_first_after, placed_runs
from fixtures.tiny_pipes import load_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's GPU kernels need a CUDA device")
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000", compile_blocks=True)


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("plan", ["every block kept", "block 0 kept, the others streamed whole"])
def test_compiled_blocks_graphed_equal_them_eager_and_round_like_the_compiler(tiny_wan_dir, plan: str) -> None:
    streamed: list[int] = []
    between = keep_first_after(streamed) if plan.startswith("block 0") else None
    extra = {"stream_parts": False} if between else {}
    plain, _ = placed_runs(load_wan(tiny_wan_dir), OffloadConfig(**BASE, **extra).replace(compile_blocks=False),
                           runs=4, between=between)
    eager, off = placed_runs(load_wan(tiny_wan_dir), OffloadConfig(**BASE, **extra, cuda_graphs=False), runs=4,
                             between=between)
    graphed, on = placed_runs(load_wan(tiny_wan_dir), OffloadConfig(**BASE, **extra), runs=4, between=between)
    assert off["compiled_calls"] > 0 and on["compiled_calls"] > 0 and on["graphs"] > 0 and on["graphs_refused"] == 0
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))
    assert max(_close(a, b) for a, b in zip(eager, plain, strict=True)) < 2e-2

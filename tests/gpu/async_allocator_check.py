"""Run by `test_async_allocator.py` in a process whose allocator is ``backend:cudaMallocAsync``
(ComfyUI's default; chosen before CUDA starts, so never in the suite's own process): the tiny wide
Wan with fp8 matmuls, its plan changed after the first run, three runs launched as CUDA graphs
equal to three eager runs (a capture's outputs are freed inside its graph: freed outside it before
its first launch, they abort the process there)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from fixtures.fp8_matmul import wide_wan
from fixtures.graph_runs import keep_first_after, placed_runs

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000")


def test_a_streamed_plan_runs_as_graphs_under_cuda_malloc_async(tiny_wan_dir) -> None:
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
    eager, _ = placed_runs(wide_wan(tiny_wan_dir), OffloadConfig(**BASE, cuda_graphs=False), 3, keep_first_after([]))
    outs, details = placed_runs(wide_wan(tiny_wan_dir), OffloadConfig(**BASE), 3, keep_first_after([]))
    assert details["graphs"] > 0
    assert all(torch.equal(a, b) for a, b in zip(eager, outs, strict=True))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))

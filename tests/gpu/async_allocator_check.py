"""Run by `test_async_allocator.py` in a process whose allocator is ``backend:cudaMallocAsync``
(ComfyUI's default; chosen before CUDA starts, so never in the suite's own process): the tiny wide
Wan with fp8 matmuls, its plan changed after the first run, three runs equal to eager. With
``GRAPHS_FORCED=1`` the allocator guard is lifted (`memory.graphs_allowed`): the bench's
``asyncgraphs`` row, which asks whether CUDA graphs themselves break under this allocator."""

from __future__ import annotations

import os

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig, memory
from diffusers_offload.offload_core.transport import streamer as streamer_module
from fixtures.fp8_matmul import wide_wan
from fixtures.graph_runs import keep_first_after, placed_runs

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000")
FORCED = os.environ.get("GRAPHS_FORCED") == "1"


def test_a_streamed_plan_runs_under_cuda_malloc_async(tiny_wan_dir, monkeypatch) -> None:
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
    if FORCED:
        monkeypatch.setattr(streamer_module, "graphs_allowed", lambda device: True)
    else:
        assert not memory.graphs_allowed(torch.device("cuda"))
    eager, _ = placed_runs(wide_wan(tiny_wan_dir), OffloadConfig(**BASE, cuda_graphs=False), 3, keep_first_after([]))
    outs, details = placed_runs(wide_wan(tiny_wan_dir), OffloadConfig(**BASE), 3, keep_first_after([]))
    assert (details["graphs"] > 0) is FORCED
    assert all(torch.equal(a, b) for a, b in zip(eager, outs, strict=True))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))

"""`graph_worth.py` on the GPU: a workload whose device work outlasts its eager launch by far (a
device sleep at its last block's entry; the clock starts at the first block's) runs without CUDA
graphs after its first forward; one whose launch is the step (the tiny Wan as it is) keeps them;
both equal their eager outputs, and nothing of ours stays after release. Skipped where there is
no CUDA device (CI)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from fixtures.graph_runs import placed_runs
from fixtures.tiny_pipes import load_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000")
SLEEP_CYCLES = 200_000_000  # about 0.1 s of device time a forward, far beyond the tiny Wan's launch


def _slowed(pipe):
    pipe.transformer.blocks[-1].register_forward_pre_hook(lambda _module, _args: torch.cuda._sleep(SLEEP_CYCLES))
    return pipe


@pytest.mark.parametrize("device_bound", [True, False])
def test_graphs_only_for_workloads_whose_launch_sets_the_pace(tiny_wan_dir, device_bound: bool) -> None:
    def pipe():
        loaded = load_wan(tiny_wan_dir)
        return _slowed(loaded) if device_bound else loaded

    eager, _ = placed_runs(pipe(), OffloadConfig(**BASE, cuda_graphs=False), 3)
    outs, details = placed_runs(pipe(), OffloadConfig(**BASE), 3)
    assert details["graphs_aside"] == int(device_bound)
    assert (details["graphs"] == details["head_graphs"] == 0) == device_bound
    assert all(torch.equal(a, b) for a, b in zip(eager, outs, strict=True))

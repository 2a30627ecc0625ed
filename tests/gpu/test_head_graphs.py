"""The non-block part's CUDA graphs (``transport/head_graphs.py``) on the families whose non-block
part has many children (Flux six, H3 ten, LTX-2 eighteen): once captured, the graphs are replayed
run after run, not dropped and captured again each forward, and the outputs equal the eager
ones bit for bit. Skipped where there is no CUDA device (CI): bench/gpu_batch.sh row ``gputests``."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.state import leftovers
from fixtures.tiny_models import run_flux, run_h3_fl2va, run_ltx2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000")
RUNS = 4


def _runs(pipe, run, graphs: bool) -> tuple[list, list[int], dict]:
    """RUNS runs placed with every block kept: the outputs, the head cache's captures so far
    after each run, and the streamer's details after the last; then a release checked clean."""
    engine = Engine()
    engine.place(pipe, OffloadConfig(**BASE, cuda_graphs=graphs))
    streamer = engine.states(pipe)["transformer"].transport
    outs, captured = [], []
    try:
        for _ in range(RUNS):
            outs.append(tuple(t.cpu() for t in torch.utils._pytree.tree_leaves(run(pipe))))
            engine.after_run(pipe)
            captured.append(streamer.graphs.head.captured)
        details = streamer.details()
    finally:
        engine.release(pipe)
    assert leftovers(pipe.transformer) == []
    return outs, captured, details


@pytest.mark.parametrize("family", ["flux", "h3", "ltx2"])
def test_the_head_graphs_are_captured_once_and_replayed_run_after_run(family: str, request) -> None:
    pipe = request.getfixturevalue({"flux": "flux_pipe", "h3": "h3_fl2va_pipe", "ltx2": "ltx2_pipe"}[family])
    run = {"flux": run_flux, "h3": run_h3_fl2va, "ltx2": run_ltx2}[family]
    eager, _, off = _runs(pipe, run, graphs=False)
    graphed, captured, on = _runs(pipe, run, graphs=True)
    assert off["head_graphs"] == 0
    assert on["head_graphs"] >= 4 and on["head_graphs_refused"] == 0
    assert captured[-1] == captured[-2] > 0  # the last runs replayed what was captured
    for a, b in zip(eager, graphed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

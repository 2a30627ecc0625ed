"""fp8 matmuls on a CUDA device (sm_89 or newer): the tiny wide Wan's fp8 Linears run
``_scaled_mm`` eagerly and inside the streamer's CUDA graphs, with the same bits either way, with
every block kept and with a plan that streams; the output differs from bf16 compute by fp8's error
only. Skipped without CUDA (CI): run on the GPU machine (bench/gpu_batch.sh row ``gputests``)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.state import leftovers
from fixtures.fp8_matmul import REL_L2, wide_wan
from fixtures.tiny_models import run_wan

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="fp8 matmuls need a CUDA device of sm_89 or newer")
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000")


def _runs(pipe, config: OffloadConfig, keep: set[int] | None = None, runs: int = 3) -> tuple[list, dict]:
    """``runs`` runs (``keep``: after the first, only those blocks kept); outputs, details."""
    engine = Engine()
    engine.place(pipe, config)
    streamer = engine.states(pipe)["transformer"].transport
    outs = []
    try:
        for k in range(runs):
            outs.append(run_wan(pipe).cpu())
            engine.after_run(pipe)
            if k == 0 and keep is not None:
                streamer.events.unsubscribe("preload")
                streamer.set_resident(streamer.pieces_of(keep))
        details = streamer.details()
    finally:
        engine.release(pipe)
    assert leftovers(pipe.transformer) == []
    return outs, details


@pytest.mark.parametrize("keep", [None, {0}], ids=["all kept", "block 0 kept"])
def test_fp8_matmuls_graphed_equal_eager(tiny_wan_dir, monkeypatch, keep) -> None:
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(args[0].device.type)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    eager, off = _runs(wide_wan(tiny_wan_dir), OffloadConfig(**BASE, cuda_graphs=False), keep)
    assert calls and set(calls) == {"cuda"}
    graphed, on = _runs(wide_wan(tiny_wan_dir), OffloadConfig(**BASE), keep)
    assert off["graphs"] == 0 and on["graphs"] > 0 and on["graphs_refused"] == 0
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))
    bf16, _ = _runs(wide_wan(tiny_wan_dir, matmul=False), OffloadConfig(**BASE), keep, runs=1)
    assert not torch.equal(eager[0], bf16[0])
    assert (eager[0] - bf16[0]).norm() < REL_L2 * bf16[0].norm()

"""A call trusted with one input signature meets another (a new prompt's token count, a new
size): captured at its first call with it, its replay still checked, while its earlier guesses
were replayed; a call whose signature changes at every call stops being guessed. On a CUDA
device (skipped in CI): ``python3 -m pytest tests/gpu``."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.transport.graphs import GraphCache
from fixtures.graph_runs import cache_call, eager_and_captured, graph_counts, placed_runs
from fixtures.tiny_pipes import load_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000")


def test_kept_blocks_are_captured_at_their_first_call_with_a_new_size(tiny_wan_dir) -> None:
    """Two runs at 16x16 (each block captured at its second call, checked), then two at 32x16: in
    the first of those each block runs eagerly once and is captured after it, and every run
    equals the eager ones bit for bit."""
    readings: list[tuple[int, int, int]] = []

    def read(streamer, _k: int) -> None:
        readings.append(graph_counts(streamer))

    calls = {2: dict(height=32), 3: dict(height=32)}
    eager, _ = placed_runs(load_wan(tiny_wan_dir), OffloadConfig(**BASE, cuda_graphs=False), runs=4, calls=calls)
    graphed, on = placed_runs(load_wan(tiny_wan_dir), OffloadConfig(**BASE), runs=4, between=read, calls=calls)
    assert eager_and_captured(readings[1], readings[2]) == (on["blocks"], on["blocks"])
    assert on["graphs_refused"] == 0 and eager[2].shape != eager[0].shape
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


def test_a_call_whose_signature_changes_every_time_stops_being_guessed() -> None:
    """Trusted with one float, a call is captured at first sight of the next two (checked: the
    graphs compute their own float); a third is not while neither was replayed; replaying one
    lets the next new one be guessed again."""
    cache, owner = GraphCache(torch.device("cuda"), True), (("scale",), ())
    x = torch.arange(4.0, device="cuda")

    def call(s: float) -> str:
        return cache_call(cache, owner, lambda t, s: t * s, (x,), {"s": s})

    assert [call(1.0) for _ in range(3)] == ["eager", "capture", "replay"]
    assert [call(2.0), call(3.0), call(4.0)] == ["capture", "capture", "eager"]
    assert [call(2.0), call(5.0), call(6.0)] == ["replay", "capture", "eager"]
    cache.forget()
    assert [call(7.0), call(8.0)] == ["eager", "eager"]  # nothing trusted after a weight write

"""`graph_worth.py` on the GPU: a workload whose device work outlasts its eager launch by far (a
device sleep at its last block's entry; the clock starts at the first block's) runs without CUDA
graphs after its second forward (timed, nothing captured in it); one whose launch is the step (the
tiny Wan as it is) keeps them; both equal their eager outputs, and nothing of ours stays after
release. Skipped where there is no CUDA device (CI)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.transport.graphs import GraphCache
from fixtures.graph_runs import cache_call, placed_runs
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


def _wait(_module, _args) -> None:
    if not torch.cuda.is_current_stream_capturing():
        torch.cuda.current_stream().synchronize()


def test_the_timed_forward_does_not_count_the_last_ones_tail(tiny_wan_dir) -> None:
    """Device-bound forwards that wait for the device once, at their second block (as a full launch
    queue makes the host wait): the timed forward follows the first with its sleep still queued,
    which must not read as its own launch time and keep graphs on."""
    def pipe():
        loaded = _slowed(load_wan(tiny_wan_dir))
        loaded.transformer.blocks[1].register_forward_pre_hook(_wait)
        return loaded

    eager, _ = placed_runs(pipe(), OffloadConfig(**BASE, cuda_graphs=False), 2)
    outs, details = placed_runs(pipe(), OffloadConfig(**BASE), 2)
    assert details["graphs_aside"] == 1 and details["graphs"] == 0
    assert all(torch.equal(a, b) for a, b in zip(eager, outs, strict=True))


def test_graphs_come_back_for_good_once_a_workload_is_launch_bound(tiny_wan_dir) -> None:
    """Runs alternate a slowed 32x32 workload (device-bound: graphs stand aside after its first two
    forwards) and the 16x16 one as it is (launch-bound: graphs back on, for both from then on). The
    16x16 run after the second slowed run replays what it captured before: nothing dropped and
    captured again turn by turn."""
    slow, captured = {"on": True}, {}
    calls = {k: {"height": 32, "width": 32} for k in (0, 2, 4)}

    def pipe():
        loaded = load_wan(tiny_wan_dir)
        loaded.transformer.blocks[-1].register_forward_pre_hook(
            lambda _module, _args: torch.cuda._sleep(SLEEP_CYCLES) if slow["on"] else None)
        return loaded

    def between(streamer, k: int) -> None:
        captured[k] = streamer.graphs.cache.captured
        slow["on"] = k + 1 in calls

    eager, _ = placed_runs(pipe(), OffloadConfig(**BASE, cuda_graphs=False), 5, between, calls)
    slow["on"] = True
    outs, details = placed_runs(pipe(), OffloadConfig(**BASE), 5, between, calls)
    assert details["graphs_aside"] == 0 and details["graphs"] > 0
    assert captured[0] == 0 and captured[3] == captured[2]
    assert all(torch.equal(a, b) for a, b in zip(eager, outs, strict=True))


def test_a_held_cache_neither_captures_nor_counts_a_call() -> None:
    """While held (the forward `graph_worth` times), a call runs eagerly and does not count towards
    its capture, so the first call after the hold is captured as the held one would have been; a
    trusted graph still replays while held."""
    cache, owner = GraphCache(torch.device("cuda"), True), (("double",), ())
    x = torch.arange(4.0, device="cuda")

    def call() -> str:
        return cache_call(cache, owner, lambda t: t * 2, (x,), {})

    assert call() == "eager"
    cache.held = True
    assert call() == "eager" and cache.captured == 0
    cache.held = False
    assert [call(), call()] == ["capture", "replay"]
    cache.held = True
    assert call() == "replay"

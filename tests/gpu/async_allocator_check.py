"""Run by `test_async_allocator.py` in a process whose allocator is ``backend:cudaMallocAsync``
(ComfyUI's default; chosen before CUDA starts, so never in the suite's own process): the tiny wide
Wan with fp8 matmuls, its plan changed after the first run, three runs launched as CUDA graphs
equal to three eager runs (a capture's outputs are freed inside its graph: freed outside it before
its first launch, they abort the process there); and the driver's graph memory a first launch
takes: counted by the graph cache, given back when its graphs go (or their weights move), waited
for where the card is short of it, and a launch short of it."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.transport import graph_memory
from diffusers_offload.offload_core.transport.graphs import GraphCache
from fixtures.fp8_matmul import wide_wan
from fixtures.graph_runs import keep_first_after, placed_runs

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000")
DEVICE = torch.device("cuda")
GIB = 1 << 30
WIDE = 32  # the test call's intermediate is WIDE times its 32 MiB input: 1 GiB


def wide_call(x: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(0).expand(WIDE, *x.shape) * 2).sum(0)


def test_a_streamed_plan_runs_as_graphs_under_cuda_malloc_async(tiny_wan_dir) -> None:
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
    eager, _ = placed_runs(wide_wan(tiny_wan_dir), OffloadConfig(**BASE, cuda_graphs=False), 3, keep_first_after([]))
    outs, details = placed_runs(wide_wan(tiny_wan_dir), OffloadConfig(**BASE), 3, keep_first_after([]))
    assert details["graphs"] > 0
    assert all(torch.equal(a, b) for a, b in zip(eager, outs, strict=True))


def test_graphs_whose_weights_moved_go_with_their_driver_memory(tiny_wan_dir) -> None:
    """After the first run block 0 is kept: the graphs keyed by where its weights lay go, the
    driver's graph memory is trimmed (`BlockGraphs.drop_moved`), and the runs after replay the
    eager outputs."""
    eager, _ = placed_runs(wide_wan(tiny_wan_dir), OffloadConfig(**BASE, cuda_graphs=False), 3, keep_first_after([]))
    keep, seen = keep_first_after([]), []

    def keep_and_drop(streamer, k: int) -> None:
        keep(streamer, k)
        if k == 0:
            cache = streamer.graphs.cache
            seen.append((len(cache), graph_memory.reserved(DEVICE), cache.driver_bytes))
            streamer.graphs.drop_moved(frozenset(streamer.resident_indices()))
            seen.append((len(cache), graph_memory.reserved(DEVICE), cache.driver_bytes))

    outs, details = placed_runs(wide_wan(tiny_wan_dir), OffloadConfig(**BASE), 3, keep_and_drop)
    (graphs, reserved, _mapped), (graphs_after, reserved_after, mapped_after) = seen
    assert 0 < graphs_after < graphs and reserved_after <= reserved and mapped_after == 0
    assert details["graphs"] > 0 and all(torch.equal(a, b) for a, b in zip(eager, outs, strict=True))


def matmul_call(x: torch.Tensor) -> torch.Tensor:
    return x @ x


def wide_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return wide_call(x)[: w.numel()].view_as(w) @ w


def _captured(cache: GraphCache, x: torch.Tensor, call=wide_call):
    """``call`` on ``x`` planned twice through ``cache`` and captured after the second: its
    graph, replayed once (the capture's check), and the eager output."""
    owner = (("wide",), ("here",))
    assert cache.plan(owner, (x,), {}) is None
    assert cache.plan(owner, (x,), {}) == GraphCache.CAPTURE
    reference = call(x)
    assert cache.capture(owner, "wide", call, (x,), {}, reference, [])
    entry = cache.plan(owner, (x,), {})
    entry.inputs = []  # (not replayed here)
    return entry, reference


@torch.no_grad()
def test_a_first_launch_takes_driver_memory_the_cache_counts_and_gives_back() -> None:
    x = torch.randn(8 << 20, device=DEVICE)
    before = graph_memory.reserved(DEVICE)
    cache = GraphCache(DEVICE, True)
    _captured(cache, x)
    took = graph_memory.reserved(DEVICE) - before
    assert took >= GIB and cache.driver_bytes == took and cache.nbytes >= took
    assert cache.need >= GIB and took <= cache.need + graph_memory.LAUNCH_MARGIN  # its footprint, read before the launch
    cache.clear()
    assert graph_memory.reserved(DEVICE) <= before and cache.nbytes == 0


@torch.no_grad()
def test_a_launch_short_of_memory_is_the_allocators_error_and_ends_graphs(monkeypatch) -> None:
    """The card filled to half a GiB short of the graph's 1 GiB: its launch fails with a CUDA
    error, raised as the allocator's out-of-memory error, and no call is graphed after it."""
    monkeypatch.setattr(graph_memory, "_launch_failed", [])
    x = torch.randn(8 << 20, device=DEVICE)
    cache = GraphCache(DEVICE, True)
    entry, _reference = _captured(cache, x)
    graph_memory.trim(DEVICE)  # the graph's memory mapped again at its next launch
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(DEVICE)
    hog = torch.empty(free - GIB // 2, dtype=torch.uint8, device=DEVICE)
    try:
        entry.inputs = [x]
        with pytest.raises(torch.OutOfMemoryError, match="CUDA graph's launch"):
            entry.replay()
    finally:
        del hog
    assert graph_memory.launch_failed() and not cache.on and cache.plan((("wide",), ("here",)), (x,), {}) is None
    cache.clear()


def _fill_to(room: int) -> torch.Tensor:
    """A tensor taking the card's free memory down to ``room`` bytes, the allocator's cache emptied first."""
    torch.cuda.empty_cache()
    return torch.empty(torch.cuda.mem_get_info(DEVICE)[0] - room, dtype=torch.uint8, device=DEVICE)


@torch.no_grad()
def test_a_graph_short_of_room_waits_eagerly_then_launches(monkeypatch) -> None:
    """The card filled to half a GiB short of a graph's 1 GiB: the captured graph is kept, its check
    replay waiting (no launch fails, no driver memory is taken), its call stays eager and the cache
    says what it waits for; with room again the next capture checks it, and it replays the eager output."""
    monkeypatch.setattr(graph_memory, "_launch_failed", [])
    x, owner = torch.randn(8 << 20, device=DEVICE), (("wide",), ("here",))
    cache = GraphCache(DEVICE, True)
    assert cache.plan(owner, (x,), {}) is None and cache.plan(owner, (x,), {}) == GraphCache.CAPTURE
    reference = wide_call(x)
    before = graph_memory.reserved(DEVICE)
    hog = _fill_to(GIB // 2)
    try:
        assert not cache.capture(owner, "wide", wide_call, (x,), {}, reference, [])
        assert cache.need >= GIB and cache.waiting == cache.need and len(cache) == 0 and cache.refused == 0
        assert cache.plan(owner, (x,), {}) is None  # still short: eager, not captured again
    finally:
        del hog
    assert not graph_memory.launch_failed() and graph_memory.reserved(DEVICE) == before
    assert cache.plan(owner, (x,), {}) == GraphCache.CAPTURE
    assert cache.capture(owner, "wide", wide_call, (x,), {}, wide_call(x), [])
    assert torch.equal(cache.plan(owner, (x,), {}).replay(), reference)
    cache.clear()
    assert cache.waiting == 0


def wide_then_fail(x: torch.Tensor) -> torch.Tensor:
    _wide = wide_call(x)  # made inside the capture, held by this frame when it raises
    raise RuntimeError("a call that cannot be captured")


@torch.no_grad()
def test_a_capture_that_raises_frees_what_it_made_inside_it() -> None:
    """A call raising inside its capture after allocating (FLUX.2's third prompt, run 65): its
    tensors are freed in the capture, not from outside a graph that is gone (which aborts the
    process); the call is refused, and the next capture launches and replays."""
    x, owner = torch.randn(8 << 20, device=DEVICE), (("failing",), ("here",))
    cache = GraphCache(DEVICE, True)
    assert cache.plan(owner, (x,), {}) is None and cache.plan(owner, (x,), {}) == GraphCache.CAPTURE
    assert not cache.capture(owner, "failing", wide_then_fail, (x,), {}, wide_call(x), [])
    torch.cuda.synchronize()
    assert cache.refused == 1 and len(cache) == 0
    entry, reference = _captured(cache, x)
    entry.inputs = [x]
    assert torch.equal(entry.replay(), reference)
    cache.clear()


@torch.no_grad()
def test_a_capture_allocates_no_matmul_workspace() -> None:
    """A cache's first capture of a matmul allocates only the product in its graph: cuBLAS's
    workspaces for the capture stream were made outside it (`graph_memory.own_workspaces`; made
    inside, FLUX.2's first prompt faulted in a later graph's first launch: run 65)."""
    x = torch.randn(512, 512, device=DEVICE)
    entry, reference = _captured(GraphCache(DEVICE, True), x, matmul_call)
    assert 0 < entry.need <= reference.nbytes + (1 << 20)


@torch.no_grad()
def test_a_graph_launched_before_an_earlier_unlaunched_one_runs(monkeypatch) -> None:
    """Graphs of one stream launch in any order: a cache's first capture (a matmul among its calls)
    waits for room unlaunched, a second call's graph captured after it launches first, and both
    replay their eager outputs. (FLUX.2 faulted in this order when the first capture made the
    stream's cuBLAS workspace, run 65; this small matmul does not read it, so that cause is
    `test_a_capture_allocates_no_matmul_workspace`'s.)"""
    monkeypatch.setattr(graph_memory, "_launch_failed", [])
    x, w = torch.randn(8 << 20, device=DEVICE), torch.randn(1024, 1024, device=DEVICE)
    first, second = (("first",), ("here",)), (("second",), ("here",))
    cache = GraphCache(DEVICE, True)
    for owner, args in ((first, (x, w)), (second, (w,))):
        assert cache.plan(owner, args, {}) is None and cache.plan(owner, args, {}) == GraphCache.CAPTURE
    reference = wide_matmul(x, w)
    hog = _fill_to(GIB // 2)
    try:
        assert not cache.capture(first, "first", wide_matmul, (x, w), {}, reference, [])
    finally:
        del hog
    assert cache.plan(second, (w,), {}) == GraphCache.CAPTURE
    assert cache.capture(second, "second", matmul_call, (w,), {}, matmul_call(w), [])
    assert torch.equal(cache.plan(second, (w,), {}).replay(), matmul_call(w))
    assert cache.plan(first, (x, w), {}) == GraphCache.CAPTURE
    assert cache.capture(first, "first", wide_matmul, (x, w), {}, reference, [])
    assert torch.equal(cache.plan(first, (x, w), {}).replay(), reference)
    assert not graph_memory.launch_failed()
    cache.clear()


@torch.no_grad()
def test_a_trim_makes_live_graphs_launch_first_again(monkeypatch) -> None:
    """A trim (any cache's drop) takes back the driver's memory of every idle graph on the device:
    a live graph then waits for room like a first launch instead of failing, and is counted as one
    (the preload's DEBUG line per forward gives their number and host time)."""
    monkeypatch.setattr(graph_memory, "_launch_failed", [])
    x, owner = torch.randn(8 << 20, device=DEVICE), (("wide",), ("here",))
    cache = GraphCache(DEVICE, True)
    _captured(cache, x)
    assert cache.first_launches == 1  # the capture's check replay
    assert graph_memory.trim(DEVICE) >= GIB and cache.driver_bytes == 0
    hog = _fill_to(GIB // 2)
    try:
        assert cache.plan(owner, (x,), {}) is None and cache.waiting >= GIB
    finally:
        del hog
    assert not graph_memory.launch_failed()
    entry = cache.plan(owner, (x,), {})
    assert torch.equal(entry.replay(), wide_call(x)) and cache.driver_bytes >= GIB
    assert cache.first_launches == 2 and cache.first_launch_s > 0  # mapped again: counted, timed on the host
    assert torch.equal(cache.plan(owner, (x,), {}).replay(), wide_call(x)) and cache.first_launches == 2
    cache.clear()


@torch.no_grad()
def test_a_capture_after_every_graph_went_takes_a_new_pool_and_frees_stay_immediate() -> None:
    """Every graph dropped (its weights moved), a capture in the new place goes to a new pool:
    captured into the pool whose last graph went, the host allocator asserts (Qwen-Image's second
    prompt, run 69). The call is captured and replays its eager output, and a tensor made before
    it and freed after goes back to the driver at once."""
    x, there = torch.randn(8 << 20, device=DEVICE), (("wide",), ("there",))
    cache = GraphCache(DEVICE, True)
    _captured(cache, x)
    made_before = [torch.empty(GIB, dtype=torch.uint8, device=DEVICE)]
    assert cache.drop(lambda owner: True) == 1 and len(cache) == 0
    assert cache.plan(there, (x,), {}) == GraphCache.CAPTURE  # trusted: captured at its first call there
    assert cache.capture(there, "wide", wide_call, (x,), {}, wide_call(x), []) and cache.refused == 0
    assert torch.equal(cache.plan(there, (x,), {}).replay(), wide_call(x))
    assert _freed_goes_back(made_before)
    cache.clear()


def _freed_goes_back(made_before: list[torch.Tensor]) -> bool:
    """Whether the 1 GiB tensor in ``made_before`` (made before what is tested), freed now, goes
    back to the driver at the next empty-cache: a routing left on defers it."""
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info(DEVICE)[0]
    made_before.clear()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(DEVICE)[0] >= free + GIB - (64 << 20)


@torch.no_grad()
def test_a_capture_refused_at_its_start_leaves_no_allocator_routing() -> None:
    """A capture torch refuses at its start (into a shared pool whose last graph went: the host
    allocator's assert of run 69) ends the device allocator's routing to that pool
    (`graph_memory.record`): a tensor made before it and freed after goes back at once (left on,
    cudaMallocAsync defers that free for good), and a capture into a new pool runs."""
    x, pool, side = torch.ones(1 << 20, device=DEVICE), torch.cuda.graph_pool_handle(), torch.cuda.Stream(DEVICE)
    first, refused, again = (graph_memory.new_graph() for _ in range(3))
    with torch.cuda.stream(side):
        graph_memory.record(first, pool, lambda: x.mul_(1.0))  # in place: nothing allocated in the capture
        first.reset()
        made_before = [torch.empty(GIB, dtype=torch.uint8, device=DEVICE)]
        with pytest.raises(RuntimeError):
            graph_memory.record(refused, pool, lambda: x.mul_(1.0))
        refused.reset()
        assert _freed_goes_back(made_before)
        graph_memory.record(again, torch.cuda.graph_pool_handle(), lambda: x.mul_(2.0))
        again.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 2.0))
    again.reset()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))

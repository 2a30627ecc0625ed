"""`BlockGraphs.drop_moved`: a graph bakes in where its weights lie, so after a plan change the
graphs keyed by a place their weights left (a block kept since, a block streamed again, a ring
buffer given back) can never replay; under cudaMallocAsync each still holds the driver's memory
its first launch mapped, so they are dropped and that memory trimmed, while graphs still in place
stay (a dropped guess no longer counts against new ones). Under the native allocator (no driver
memory mapped) nothing is dropped; a drop that leaves no graph forgets their pool. The placement is
real (a tiny Wan streamed on the CPU); the graphs are stand-ins, as the CPU cannot capture. And the
report says what a graph waits for."""

from __future__ import annotations

import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.transport import graph_memory
from diffusers_offload.offload_core.transport.block_graphs import BlockGraphs
from diffusers_offload.offload_core.transport.graphs import CallGraph, GraphCache, StaticIO
from fixtures.tiny_pipes import run_wan

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


class Graph:
    """Stands in for `torch.cuda.CUDAGraph` (which needs a GPU): a drop only resets it."""

    def __init__(self) -> None:
        self.reset_calls = 0

    def reset(self) -> None:
        self.reset_calls += 1


def add(graphs: BlockGraphs, owner, where: tuple[int, ...]) -> Graph:
    """A trusted graph of ``owner`` (a block or a unit) keyed as `BlockGraphs.key` keys it, with its
    weights at ``where``."""
    units = owner.units if hasattr(owner, "units") else [owner]
    graph = Graph()
    key = ((id(owner), tuple(u.computed for u in units)), where)
    graphs.cache._entries[(key, ("signature",))] = CallGraph(graph, StaticIO([]), None, [], torch.device("cpu"))
    return graph


def test_graphs_of_weights_placed_elsewhere_go_with_the_driver_memory_they_hold(wan_pipe, monkeypatch) -> None:
    trims: list[torch.device] = []
    monkeypatch.setattr(graph_memory, "trim", lambda device: trims.append(device) or 0)
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(**BASE, preload="off"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    run_wan(wan_pipe, num_inference_steps=1)  # the ring's buffer is made
    graphs, units = streamer.graphs, streamer.prefetch.units
    (ring,) = streamer.prefetch.ring.addresses
    first, second = units[0].block, units[3].block
    pieces_of = lambda block: {u.piece.index for u in block.units}  # noqa: E731
    in_ring = {u.index: add(graphs, u, (ring,)) for u in (units[0], units[3], units[6])}
    monkeypatch.setattr(graph_memory, "_async", True)  # cudaMallocAsync: their launches map the driver's memory
    ((owner, signature),) = [k for k, e in graphs.cache._entries.items() if e.graph is in_ring[0]]
    graphs.cache._entries[(owner, signature)].guessed = True  # captured at first sight, not replayed yet
    graphs.cache._guesses[owner[0]] = {signature}

    streamer.set_resident(pieces_of(first))  # the first block kept: its unit's graph in the ring moved
    graphs.drop_moved(frozenset(pieces_of(first)))
    assert [in_ring[i].reset_calls for i in (0, 3, 6)] == [1, 0, 0] and len(graphs.cache) == 2
    assert graphs.cache._guesses[owner[0]] == set()  # its guess no longer waits for a replay
    assert trims == [streamer.device]
    kept = add(graphs, first, tuple(u.kept.data_ptr() for u in first.units))
    graphs.drop_moved(frozenset(pieces_of(first)))  # the same placement: nothing moved
    assert kept.reset_calls == 0 and len(graphs.cache) == 3 and len(trims) == 1

    streamer.set_resident(pieces_of(second))  # the first block streamed again, the second kept
    graphs.drop_moved(frozenset(pieces_of(second)))
    assert (kept.reset_calls, in_ring[3].reset_calls, in_ring[6].reset_calls) == (1, 1, 0)
    streamer.drop_prefetched()  # the ring's buffer given back
    graphs.drop_moved(frozenset(pieces_of(second)))
    assert in_ring[6].reset_calls == 1 and len(graphs.cache) == 0 and len(trims) == 3

    native = add(graphs, second, tuple(u.kept.data_ptr() for u in second.units))
    monkeypatch.setattr(graph_memory, "_async", False)  # the native allocator: graphs share one pool, map nothing
    streamer.set_resident(pieces_of(first))  # the second block streamed again
    graphs.drop_moved(frozenset(pieces_of(first)))
    assert native.reset_calls == 0 and len(graphs.cache) == 1 and len(trims) == 3
    graphs.cache._entries.clear()
    engine.release(wan_pipe)


def test_kept_blocks_given_back_and_taken_again_elsewhere_drop_their_graphs(wan_pipe, monkeypatch) -> None:
    """The same pieces kept at two plans, but given back in between (a decode's room, which is
    no plan; Qwen-Image's decode gives back 3.45 GiB of kept blocks at each prompt, run 69) and
    taken again at other addresses: their graphs go with the driver memory they hold, while the
    same pieces in the same place keep theirs."""
    trims: list[torch.device] = []
    monkeypatch.setattr(graph_memory, "trim", lambda device: trims.append(device) or 0)
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(**BASE, preload="off"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    run_wan(wan_pipe, num_inference_steps=1)
    graphs, first = streamer.graphs, streamer.prefetch.units[0].block
    kept = frozenset(u.piece.index for u in first.units)
    monkeypatch.setattr(graph_memory, "_async", True)
    streamer.set_resident(set(kept))
    graphs.drop_moved(kept)
    where = tuple(u.kept.data_ptr() for u in first.units)
    graph = add(graphs, first, where)
    graphs.drop_moved(kept)  # the same pieces in the same place
    assert graph.reset_calls == 0 and not trims
    streamer.give_back(sum(streamer.pieces[i].nbytes for i in kept))  # a decode's room
    fillers = [torch.empty(streamer.pieces[i].nbytes, dtype=torch.uint8) for i in kept]  # (their old addresses)
    streamer.set_resident(set(kept))  # taken again
    del fillers
    assert tuple(u.kept.data_ptr() for u in first.units) != where
    graphs.drop_moved(kept)
    assert graph.reset_calls == 1 and trims == [streamer.device] and len(graphs.cache) == 0
    engine.release(wan_pipe)


def test_a_drop_that_leaves_no_graph_forgets_their_pool() -> None:
    """torch refuses a capture into a shared pool whose last graph went (bench/README.md, run 69),
    so the cache forgets its pool once a drop leaves no graph, kept or awaiting its check: the next
    capture makes a new one. While one graph is left, the pool stays theirs."""
    cache, kept, unchecked = GraphCache(torch.device("cpu"), False), Graph(), Graph()
    cache._entries[("here", ("signature",))] = CallGraph(kept, StaticIO([]), None, [], torch.device("cpu"))
    cache._unchecked[("there", ("signature",))] = CallGraph(unchecked, StaticIO([]), None, [], torch.device("cpu"))
    cache._pool = pool = (1, 0)  # as a capture made it
    assert cache.drop(lambda owner: owner == "here") == 1
    assert len(cache) == 0 and cache._pool == pool  # the graph awaiting its check still holds it
    assert cache.drop(lambda owner: True) == 1
    assert (kept.reset_calls, unchecked.reset_calls) == (1, 1) and cache._pool is None


def test_each_plan_applied_is_checked_for_moved_graphs(wan_pipe, monkeypatch) -> None:
    seen: list[frozenset[int]] = []
    monkeypatch.setattr(BlockGraphs, "drop_moved", lambda self, kept: seen.append(kept))
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(**BASE, preload="auto"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    run_wan(wan_pipe, num_inference_steps=2)
    assert seen and seen[-1] == frozenset(streamer.resident_indices())
    engine.release(wan_pipe)


def test_the_report_says_what_a_graph_waits_for(wan_pipe) -> None:
    """A first launch short of free memory (`GraphCache._room_for`) shows in the component's line."""
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(**BASE, preload="off"))
    cache = engine.states(wan_pipe)["transformer"].transport.graphs.cache
    assert "waits for" not in engine.report(wan_pipe).component("transformer").line()
    cache.waiting = 3 << 29
    assert ", a CUDA graph waits for 1.50 GiB free to launch" in engine.report(wan_pipe).component("transformer").line()
    engine.release(wan_pipe)

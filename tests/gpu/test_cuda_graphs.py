"""The streamer's CUDA graphs (``transport/graphs.py``), on a CUDA device: the tiny Wan pipeline's
outputs with graphs equal its outputs without, bit for bit, whatever happens to the kept set
(a plan that streams, a weight write, fp8 storage, a block that cannot be captured); nothing of ours
stays after release. Skipped where there is no CUDA device (CI): run on the GPU machine with
``python3 -m pytest tests/gpu`` (bench/gpu_batch.sh row ``gputests``)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import store_fp8
from diffusers_offload.offload_core.preload import fit as fit_module
from diffusers_offload.offload_core.transport import call_keys, graph_memory
from fixtures.graph_runs import eager_and_captured, graph_counts, keep_first_after, placed_runs
from fixtures.tiny_pipes import load_wan, run_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000")
FORWARDS = 4  # the denoiser's forwards in a run: two steps, each with and without guidance (`run_wan`)


@pytest.fixture
def pipe(tiny_wan_dir):
    return load_wan(tiny_wan_dir)


def test_kept_blocks_replay_graphs_that_equal_the_eager_forward(pipe) -> None:
    eager, off = placed_runs(pipe, OffloadConfig(**BASE, cuda_graphs=False))
    graphed, on = placed_runs(pipe, OffloadConfig(**BASE))
    assert off["graphs"] == off["head_graphs"] == 0
    assert on["graphs"] == on["blocks"] > 0 and on["graphs_refused"] == 0
    assert on["head_graphs"] >= 3 and on["head_graphs_refused"] == 0  # rope, patch and condition embedders at least
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


def test_blocks_bound_whole_plan_their_buffers_a_block_ahead(pipe) -> None:
    """Graphed blocks in parts are bound whole (`BlockStreamer._bind_whole`) and free their buffers
    only at their exit, so the plan counts its streaming buffers in blocks: the streamed rest bound
    and the window's rest ahead (fewer, and the next block's copies wait for that exit). Without
    graphs, in units. A retune that turns the graphs off re-plans it."""
    engine, config = Engine(), OffloadConfig(**{**BASE, "preload": "off"})
    engine.place(pipe, config)
    streamer = engine.states(pipe)["transformer"].transport
    try:
        rest = max(len(p.units) for p in streamer.pieces if not p.core)
        assert rest >= 2 and streamer.driver.planner.buffers.whole and streamer.ring.capacity == 2 * rest
        run_wan(pipe)
        assert streamer.details()["graphs"] > 0
        engine.place(pipe, config.replace(cuda_graphs=False))  # a retune
        assert not streamer.driver.planner.buffers.whole and streamer.ring.capacity == 2
    finally:
        engine.release(pipe)


def _fp8(p):
    p.transformer.to(torch.bfloat16)
    store_fp8(p.transformer, torch.float8_e4m3fn, torch.bfloat16)
    return p


@pytest.mark.parametrize("storage", ["model dtype", "fp8"])
def test_a_plan_that_streams_graphs_each_streamed_unit_per_buffer(tiny_wan_dir, storage: str) -> None:
    """A plan that keeps block 0 only, streaming through two buffers (too few to bind a block
    whole): block 0 is graphed whole, each unit of the other blocks once per ring buffer it is
    bound to (its copy stays outside the graph, an fp8 unit's cast inside); the runs equal the
    eager ones bit for bit, and none waits for a copy it did not queue."""
    streamed: list[int] = []
    keep_first = keep_first_after(streamed, buffers=2)
    prepare = _fp8 if storage == "fp8" else (lambda p: p)
    eager, off = placed_runs(prepare(load_wan(tiny_wan_dir)), OffloadConfig(**BASE, cuda_graphs=False), runs=4,
                       between=keep_first)
    graphed, on = placed_runs(prepare(load_wan(tiny_wan_dir)), OffloadConfig(**BASE), runs=4, between=keep_first)
    assert off["graphs"] == 0 and on["kept"] == 1
    assert on["graphs"] >= 1 + streamed[-1] and on["graphs_refused"] == 0
    assert on["sync_loads"] == off["sync_loads"]
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


@pytest.mark.parametrize("storage", ["model dtype", "fp8"])
def test_a_capture_gets_the_memory_the_eager_forwards_left_cached(tiny_wan_dir, storage: str) -> None:
    """While a capture is under way the allocator frees no cached memory, so on a card whose only
    room is what the eager forwards left cached, a capture runs out of memory: it is made again
    once that cache is emptied, and every kept block and streamed unit (two buffers: graphed one
    by one) is graphed (fp8 units cast into the buffer eager casts use), the same bits as eager."""
    streamed: list[int] = []
    keep_first = keep_first_after(streamed, buffers=2)
    prepare = _fp8 if storage == "fp8" else (lambda p: p)
    total = torch.cuda.get_device_properties(0).total_memory

    def tight(streamer, k: int) -> None:
        keep_first(streamer, k)
        if k == 1:  # run 1 captured with room; run 2 captures again with none but the cache
            streamer.graphs.clear()
            torch.cuda.synchronize()
            cached = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            del cached  # cached, unused, as an eager forward leaves its activations
            torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total)

    eager, _ = placed_runs(prepare(load_wan(tiny_wan_dir)), OffloadConfig(**BASE, cuda_graphs=False), runs=4,
                     between=keep_first)
    try:
        graphed, on = placed_runs(prepare(load_wan(tiny_wan_dir)), OffloadConfig(**BASE), runs=4, between=tight)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert on["kept"] == 1 and on["graphs_refused"] == on["head_graphs_refused"] == 0
    assert on["graph_retries"] + on["head_graph_retries"] >= 1  # (the non-block part captures first)
    assert on["graphs"] >= 1 + streamed[-1]
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


@pytest.mark.parametrize("storage", ["model dtype", "fp8"])
def test_a_block_that_streams_its_rest_is_graphed_whole(tiny_wan_dir, storage: str) -> None:
    """A plan that keeps every block's core and streams its rest through a ring of 3 buffers: each
    streaming block is bound at its entry and graphed whole (once per pair of buffers its rest
    meets), its copies outside the graph; the runs equal the eager ones bit for bit, with the same
    copies (none queued twice) and no copy waited for that was not queued ahead."""
    prepare = _fp8 if storage == "fp8" else (lambda p: p)
    copied: list[int] = []

    def cores(streamer, k: int) -> None:
        if k == 0:
            streamer.events.unsubscribe("preload")
            streamer.set_resident({p.index for p in streamer.pieces if p.core})
            streamer.set_lookahead(3)
        copied.append(streamer.prefetch.copied)

    eager, off = placed_runs(prepare(load_wan(tiny_wan_dir)), OffloadConfig(**BASE, cuda_graphs=False), runs=8, between=cores)
    owners: set[int] = set()
    streaming: set[int] = set()

    def cores_seen(streamer, k: int) -> None:
        cores(streamer, k)
        owners.update(called[0] for called, _where in streamer.graphs.cache.owners())
        streaming.update(id(b) for b in streamer.blocks if b.index not in streamer.resident_blocks())

    graphed, on = placed_runs(prepare(load_wan(tiny_wan_dir)), OffloadConfig(**BASE), runs=8, between=cores_seen)
    assert off["graphs"] == 0 and on["kept"] == 0 and on["graphs_refused"] == 0
    assert streaming and streaming <= owners  # every streaming block has a graph of its own
    assert on["sync_loads"] == off["sync_loads"]

    def per_run(counts: list[int]) -> list[int]:
        return [b - a for a, b in zip(counts, counts[1:], strict=False)]

    assert per_run(copied[:7]) == per_run(copied[7:])  # bytes copied in runs 1-6, eager and graphed
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


def test_a_weight_write_drops_every_graph_and_the_next_ones_capture_the_new_forward(tiny_wan_dir) -> None:
    """``before_write`` (a LoRA's write: fused values, or unfused hooks on its layers) drops the
    graphs; a hook added to a kept block's layer afterwards is in the graphs captured next, as it
    is in the eager forward (a graph kept from before would skip it)."""
    def write(streamer, _k: int) -> None:
        streamer.before_write()
        assert len(streamer.graphs.cache) == 0
        streamer.blocks[0].module.ffn.register_forward_hook(lambda _m, _i, out: out + 1.0)

    eager, _ = placed_runs(load_wan(tiny_wan_dir), OffloadConfig(**BASE, cuda_graphs=False), between=write)
    graphed, on = placed_runs(load_wan(tiny_wan_dir), OffloadConfig(**BASE), between=write)
    assert on["graphs"] == on["blocks"]
    assert not torch.equal(eager[0], eager[1])  # the hook changed the output
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


def _moving_kept_blocks(counts: list[tuple[int, int]], moved: list[bool]):
    """A `between` that, after the first run, gives every kept block back and takes it again at
    new addresses (what a Wan 2.2 denoiser meets after the other one ran); ``counts`` gets the
    cache's (captured, replayed) after each run but the last, ``moved`` whether every block's
    weights lie elsewhere."""
    def move(streamer, k: int) -> None:
        cache = streamer.graphs.cache
        counts.append((cache.captured, cache.replayed))
        if k == 0:
            streamer.events.unsubscribe("preload")  # the planner would re-plan
            kept = streamer.resident_indices()
            before = {b.index: streamer.graphs.key(b)[1] for b in streamer.blocks}
            streamer.set_resident(set())
            fillers = [torch.empty(streamer.pieces[i].nbytes, dtype=torch.uint8, device="cuda") for i in kept]
            streamer.set_resident(kept)
            del fillers
            moved.append(all(streamer.graphs.key(b)[1] != before[b.index] for b in streamer.blocks))
    return move


def test_a_call_checked_once_is_captured_at_its_first_call_in_a_new_place(pipe, tiny_wan_dir) -> None:
    """A kept block taken back at new addresses is captured at its first call there, without a
    second eager forward or a check replay: the run after the move replays every call of each
    block but its first (3 of its 4 forwards; the first run captured at each block's third call,
    its second forward timed by `graph_worth.py`), and every run equals the eager ones bit for bit."""
    eager, _ = placed_runs(pipe, OffloadConfig(**BASE, cuda_graphs=False), runs=3,
                           between=_moving_kept_blocks([], []))
    counts: list[tuple[int, int]] = []
    moved: list[bool] = []
    graphed, on = placed_runs(load_wan(tiny_wan_dir), OffloadConfig(**BASE), runs=3,
                              between=_moving_kept_blocks(counts, moved))
    (captured_1, replayed_1), (captured_2, replayed_2) = counts
    assert moved == [True] and on["graphs_refused"] == 0
    assert captured_1 == on["blocks"] and captured_2 - captured_1 == on["blocks"]
    assert replayed_2 - replayed_1 == (FORWARDS - 1) * on["blocks"]
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


def test_a_streamed_unit_checked_once_is_captured_at_its_first_call_in_a_ring_made_again(tiny_wan_dir) -> None:
    """Block 0 kept, the rest streamed through two buffers: after the ring is dropped and made
    again elsewhere (a decode took its room), each streamed unit is captured at its first call in
    its new buffer, so every eager call is followed by a capture; in the run before, whose units
    were new, each ran eagerly twice before its capture. Every run equals the eager ones."""
    streamed: list[int] = []
    keep_first = keep_first_after(streamed, buffers=2)
    readings: list[tuple[int, int, int]] = []

    def remake_ring(streamer, k: int) -> None:
        keep_first(streamer, k)
        readings.append(graph_counts(streamer))
        if k == 1:
            streamer.drop_prefetched()
            fillers = [torch.empty(streamer.ring.slot_bytes, dtype=torch.uint8, device="cuda")
                       for _ in range(streamer.ring.capacity)]
            streamer.fill_ring()
            del fillers

    eager, _ = placed_runs(load_wan(tiny_wan_dir), OffloadConfig(**BASE, cuda_graphs=False), runs=4,
                           between=keep_first)
    graphed, on = placed_runs(load_wan(tiny_wan_dir), OffloadConfig(**BASE), runs=4, between=remake_ring)
    assert on["kept"] == 1 and streamed[-1] > 0 and on["graphs_refused"] == 0
    eager_1, captured_1 = eager_and_captured(readings[0], readings[1])
    eager_2, captured_2 = eager_and_captured(readings[1], readings[2])
    assert captured_1 >= streamed[-1] and eager_1 >= 2 * captured_1
    assert captured_2 >= streamed[-1] and eager_2 == captured_2
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


def test_fp8_kept_blocks_graph_their_cast(pipe, tiny_wan_dir) -> None:
    eager, _ = placed_runs(_fp8(pipe), OffloadConfig(**BASE, cuda_graphs=False))
    graphed, on = placed_runs(_fp8(load_wan(tiny_wan_dir)), OffloadConfig(**BASE))
    assert on["graphs"] == on["blocks"] and on["graphs_refused"] == 0
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


def test_fp8_pieces_held_as_compute_values_are_graphed_without_a_cast(pipe, tiny_wan_dir, monkeypatch) -> None:
    """With preload auto, every block kept and room to spare, the fp8 pieces are held as compute
    values (``held_casts.py``) and captured that way: the same bits as fp8 kept blocks casting at
    each forward, eager (a fixed budget holds none)."""
    monkeypatch.setattr(fit_module, "GROWTH_FLOOR", 0)  # auto keeps the tiny model's blocks (a few MB)
    eager, off = placed_runs(_fp8(pipe), OffloadConfig(**BASE, cuda_graphs=False), runs=4)
    auto = {**BASE, "preload": "auto"}
    graphed, on = placed_runs(_fp8(load_wan(tiny_wan_dir)), OffloadConfig(**auto), runs=4)
    assert off["held_bytes"] == 0 and on["held_bytes"] > 0
    assert on["graphs"] == on["blocks"] and on["graphs_refused"] == 0
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


def _syncing(p):
    """Block 0's forward reads a value on the host (a sync: illegal in a capture)."""
    block = p.transformer.blocks[0]
    forward = block.forward

    def reads_a_value(*args, **kwargs):
        if float(args[0].abs().amax()) < 0:  # .item(): a host read
            raise AssertionError
        return forward(*args, **kwargs)

    block.forward = reads_a_value
    return p


def test_a_block_that_cannot_be_captured_stays_eager(pipe, tiny_wan_dir) -> None:
    """A block whose capture fails is refused by name and runs eagerly; the others are graphed;
    the output is unchanged."""
    eager, _ = placed_runs(_syncing(pipe), OffloadConfig(**BASE, cuda_graphs=False))
    graphed, on = placed_runs(_syncing(load_wan(tiny_wan_dir)), OffloadConfig(**BASE))
    assert on["graphs_refused"] >= 1 and on["graphs"] == on["blocks"] - 1
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


def test_a_block_whose_capture_failed_is_not_captured_again_in_a_new_place(pipe, tiny_wan_dir) -> None:
    """After the kept blocks are taken back at new addresses, the others are captured again there,
    but the block whose capture failed is not tried again (one refusal in all); outputs unchanged."""
    eager, _ = placed_runs(_syncing(pipe), OffloadConfig(**BASE, cuda_graphs=False), runs=3,
                           between=_moving_kept_blocks([], []))
    counts: list[tuple[int, int]] = []
    moved: list[bool] = []
    graphed, on = placed_runs(_syncing(load_wan(tiny_wan_dir)), OffloadConfig(**BASE), runs=3,
                              between=_moving_kept_blocks(counts, moved))
    (captured_1, _), (captured_2, _) = counts
    assert moved == [True] and on["graphs_refused"] == 1
    assert captured_1 == captured_2 - captured_1 == on["blocks"] - 1
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))


def test_inputs_over_the_limit_stay_eager(pipe, monkeypatch) -> None:
    monkeypatch.setattr(call_keys, "INPUT_LIMIT", 0)  # read by `call_keys.describe`
    _outs, on = placed_runs(pipe, OffloadConfig(**BASE))
    assert on["graphs"] == 0 and on["graphs_refused"] == 0


def test_a_graph_launch_out_of_memory_is_a_shortage_and_ends_graphs(pipe, tiny_wan_dir, monkeypatch) -> None:
    """Under cudaMallocAsync a graph's launch takes its memory from the driver, and on a full card
    fails with a CUDA error (bench/README.md, run 61): here the second run's first launch fails so.
    It is met as a shortage (kept blocks given up, the block run again eagerly), no graph is replayed
    or captured after it, and the outputs equal the eager ones (`async_allocator_check.py` makes a
    launch fail on a full card)."""
    monkeypatch.setattr(graph_memory, "_launch_failed", [])
    replay, failed = torch.cuda.CUDAGraph.replay, []

    def full_card(graph) -> None:
        if not failed:
            failed.append(True)
            raise RuntimeError("CUDA error: out of memory")  # (torch.AcceleratorError's text)
        replay(graph)

    def fail_next_launch(streamer, k: int) -> None:
        counts.append(graph_counts(streamer))
        monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", full_card)

    counts: list[tuple[int, int, int]] = []
    eager, _ = placed_runs(pipe, OffloadConfig(**BASE, cuda_graphs=False), runs=3)
    graphed, on = placed_runs(load_wan(tiny_wan_dir), OffloadConfig(**BASE), runs=3, between=fail_next_launch)
    assert failed and graph_memory.launch_failed() and counts[0][2] > 0
    (_, replayed_0, captured_0), (_, replayed_1, captured_1) = counts
    assert replayed_1 - replayed_0 <= 1 and captured_1 == captured_0  # (the failed launch: a block's or the head's)
    assert on["graphs"] == 0  # dropped at the shortage
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))

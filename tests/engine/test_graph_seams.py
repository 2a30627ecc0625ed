"""The CPU side of the streamer's CUDA graphs (the graphs themselves run in tests/gpu): the option
reaches the streamer and a retune turns it off, a CPU placement makes none, a replay's outputs are
freed with their caller's last reference, a capture binds a kept fp8 unit's weights to values cast
into the cast buffer it shares with eager casts and gives the stored bytes back after, and a cycle that captured is measured
without the capture's allocations and is no shortage for the planner."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import store_fp8
from diffusers_offload.offload_core.preload import planner as planner_module
from diffusers_offload.offload_core.preload.measures import MeasureStore
from diffusers_offload.offload_core.transport import call_keys, graphs
from diffusers_offload.offload_core.transport.cast import CastPool, UnitCast
from fixtures.scripted_memory import ScriptedCard
from fixtures.tiny_pipes import load_wan, run_wan

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


def test_the_option_reaches_the_streamer_and_a_retune_turns_it_off(wan_pipe) -> None:
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(**BASE, preload="1000"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    assert not streamer.graphs.cache.enabled  # a CPU device: nothing to capture on
    run_wan(wan_pipe)
    details = streamer.details()
    assert (details["graphs"], details["graph_bytes"], details["graphs_refused"]) == (0, 0, 0)
    streamer.graphs.cache.enabled = True  # as on a GPU
    engine.place(wan_pipe, OffloadConfig(**BASE, preload="1000", cuda_graphs=False))  # a retune, not a re-place
    assert engine.states(wan_pipe)["transformer"].transport is streamer
    assert not streamer.graphs.cache.enabled and not streamer.graphs.head.enabled
    engine.release(wan_pipe)


def test_the_non_block_part_is_hooked_child_by_child_and_left_clean(wan_pipe) -> None:
    """Each direct child of the denoiser outside its block tower carries the head-graph hook
    (`head_graphs.py`: graphed on a GPU, a plain call here), the tower and its blocks do not, the
    output is the eager one, and a release leaves nothing of ours."""
    from diffusers_offload.offload_core.state import leftovers
    from diffusers_offload.offload_core.transport.base import STREAM_HOOK
    from diffusers_offload.offload_core.transport.head_graphs import HeadGraphHook

    def hook_of(module):
        registry = getattr(module, "_diffusers_hook", None)
        return registry.get_hook(STREAM_HOOK) if registry is not None else None

    torch.manual_seed(0)
    eager = run_wan(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(**BASE, preload="off"))
    model = wan_pipe.transformer
    head = {name for name, child in model.named_children() if isinstance(hook_of(child), HeadGraphHook)}
    assert head == {name for name, _child in model.named_children()} - {"blocks"} and head
    assert engine.states(wan_pipe)["transformer"].transport.graphs.head.signatures == 2 * len(head)  # two a child
    assert not isinstance(hook_of(model.blocks), HeadGraphHook)
    assert not any(isinstance(hook_of(b), HeadGraphHook) for b in model.blocks)
    torch.manual_seed(0)
    assert torch.equal(run_wan(wan_pipe), eager)
    engine.release(wan_pipe)
    assert leftovers(model) == []


def test_the_text_encoder_streamer_is_never_graphed(wan_pipe) -> None:
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(**BASE, mode="auto"))
    encoder = engine.states(wan_pipe)["text_encoder"].transport
    assert type(encoder).graphed is False and not encoder.graphs.cache.enabled and not encoder.graphs.head.enabled
    engine.release(wan_pipe)


def test_describe_refuses_what_a_graph_cannot_replay() -> None:
    """Host tensors, tensors needing grad, objects other than tensors and plain values, and any
    call with grad enabled stay eager."""
    with torch.no_grad():
        assert call_keys.describe((torch.ones(2),), {}) is None  # on the host
        assert call_keys.describe((), {"x": object()}) is None
    assert call_keys.describe((), {"scale": 1.0}) is None  # grad enabled
    with torch.no_grad():
        key, tensors = call_keys.describe((), {"scale": 1.0, "mode": None, "sizes": (1, 2)})
        assert tensors == [] and call_keys.rebuild(key[0], []) == ((), {"scale": 1.0, "mode": None, "sizes": (1, 2)})
        assert call_keys.describe((), {"scale": 2.0})[0] != call_keys.describe((), {"scale": 1.0})[0]


def test_a_replay_output_is_freed_when_its_caller_drops_it() -> None:
    """Rebuilding a replay's outputs leaves no reference cycle: with the garbage collector off,
    the tensors go as soon as the caller lets them go (a cycle held every replay's outputs until
    a collection, which the planner measured as activations)."""
    out = torch.ones(4)
    key = (tuple, ((out.shape, out.stride(), out.dtype, None), (dict, (("n", (int, 3)),))))
    gc.disable()
    try:
        built = call_keys.rebuild(key, [out])
        assert built[0] is out and built[1] == {"n": 3}
        alive = weakref.ref(out)
        del out, built
        assert alive() is None
    finally:
        gc.enable()


def test_a_capture_casts_a_kept_fp8_unit_into_the_fixed_buffer_eager_casts_share(tiny_wan_dir) -> None:
    """The capture's cast buffer is fixed before the eager forward that precedes it, outside
    the capture; that forward's cast and the capture's use it (no second buffer: a graph pool's
    own cast buffer is what kept captures from fitting on a tight card), the stored bytes are
    bound again after, and the buffer becomes an ordinary one when the graphs are dropped."""
    pipe = load_wan(tiny_wan_dir)
    pipe.transformer.to(torch.bfloat16)
    store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16)
    engine = Engine()
    engine.place(pipe, OffloadConfig(**BASE, preload="1000"))
    streamer = engine.states(pipe)["transformer"].transport
    casts = streamer.prefetch.casts
    unit = next(u for u in streamer.units if u.cast is not None)
    fp8 = [slot.tensor for slot in unit.slots[: unit.cast.count]]
    stored = [t.data for t in fp8]
    _buf, expected = CastPool(torch.device("cpu")).cast(unit.index, unit.cast, unit.kept)
    held = casts.held
    streamer.prefetch.fix_cast([unit])
    fixed = casts.fixed
    assert fixed is not None and fixed.dtype == torch.bfloat16
    start, end = fixed.data_ptr(), fixed.data_ptr() + fixed.nbytes

    def in_fixed() -> bool:
        return all(start <= t.data_ptr() < end for t in fp8)

    streamer.enter(unit)  # the eager forward before the capture casts into the fixed buffer
    assert in_fixed() and casts.held == max(held, fixed.nbytes)
    streamer.exit(unit)
    streamer.prefetch.capturing = True
    try:
        streamer.enter(unit)
        assert in_fixed() and all(torch.equal(t, e) for t, e in zip(fp8, expected, strict=True))
        assert streamer.learner.seen == [unit.index]  # a capture is not a forward the order learns from
        streamer.exit(unit)
        assert [t.data_ptr() for t in fp8] == [s.data_ptr() for s in stored]
        assert all(t.dtype == torch.float8_e4m3fn for t in fp8)
    finally:
        streamer.prefetch.end_capture()
    assert not streamer.prefetch.capturing and streamer.prefetch._captured == {}
    streamer.graphs.clear()
    assert casts.fixed is None
    streamer.drop_prefetched()
    assert casts.held == 0
    engine.release(pipe)


def test_the_fixed_cast_buffer_outlives_its_graphs_and_serves_one_dtype() -> None:
    """Graphs bake the fixed buffer's address in: a second `fix` keeps it (whatever dtype is
    asked), a unit of another compute dtype is not served by it, an eager unit bound to it keeps
    it through `unfix`, and only then does it become an ordinary buffer."""
    pool = CastPool(torch.device("cpu"))
    pool.resize(64 * 2)
    bf16 = UnitCast(torch.float8_e4m3fn, torch.bfloat16, 1, 64, [0], [torch.Size([8, 8])])
    fp16 = UnitCast(torch.float8_e4m3fn, torch.float16, 1, 64, [0], [torch.Size([8, 8])])
    fixed = pool.fix(torch.bfloat16)
    assert pool.fix(torch.float16) is fixed and pool.fixed_for(fp16) is None
    region = torch.zeros(64, dtype=torch.uint8)
    bound, _views = pool.cast(0, bf16, region)
    assert bound is fixed
    other, _views = pool.cast(1, bf16, region)  # the fixed one is busy: another buffer
    assert other is not fixed
    pool.release(other)
    pool.unfix()
    assert pool.fixed is None and pool.held == 2 * fixed.nbytes  # still bound, still alive
    pool.release(bound)
    pool.clear()
    assert pool.held == 0


def test_a_cycle_that_captured_is_measured_without_the_capture(wan_pipe, monkeypatch) -> None:
    """The forward's peak before a capture is measured; the capture's allocations (what it left
    allocated: its pool, its static buffers; and the allocator retry they cause) are neither a
    measure nor a shortage."""
    monkeypatch.setattr(planner_module, "process_store", MeasureStore)  # no earlier test's measures
    monkeypatch.setattr(planner_module, "growth_threshold", lambda largest: 0)  # tiny blocks are kept
    card = ScriptedCard()
    engine = Engine(memory=card)
    engine.place(wan_pipe, OffloadConfig(**BASE, preload="auto"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    planner = streamer.driver.planner
    run_wan(wan_pipe, num_inference_steps=1)
    measured, kept = planner.measured_peak(planner.last_workload), streamer.resident_indices()
    assert measured is not None and kept

    def capture_in_cycle(event, source, **_):
        if event == "cycle":  # the forward peaks 64 MiB higher, then a capture allocates and flushes the cache
            card.peak += 64 << 20
            source.notify("capturing")
            card.peak, card.retries = card.peak + (1 << 30), card.retries + 1
            card.alloc, card.base = card.alloc + (256 << 20), card.base + (256 << 20)  # left allocated
            source.notify("captured")
        return False

    streamer.events.subscribe("capture", capture_in_cycle)
    run_wan(wan_pipe, num_inference_steps=1)
    grown = planner.measured_peak(planner.last_workload) - measured
    assert abs(grown - (64 << 20)) < (1 << 20)  # (the streaming buffers' share moves by a few KiB)
    assert planner.penalty(planner.last_workload) == 0 and streamer.resident_indices() == kept
    streamer.events.unsubscribe("capture")
    engine.release(wan_pipe)


def test_a_graphed_workload_records_its_graphs_memory_and_its_plan_leaves_them_room(wan_pipe, monkeypatch) -> None:
    """Graphs on and the block calls graphable (as on a GPU; none is captured on the CPU): the
    cycle records what the graphs hold, and until they hold more than the eager peak the plan
    leaves that peak for them (`graphs_to_come`); what they hold is read apart, not as free; and
    what a graph waits for to launch is recorded with it, so the next plan leaves it room."""
    monkeypatch.setattr(planner_module, "process_store", MeasureStore)
    card = ScriptedCard()
    engine = Engine(memory=card)
    engine.place(wan_pipe, OffloadConfig(**BASE, preload="auto"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    planner, cache = streamer.driver.planner, streamer.graphs.cache
    run_wan(wan_pipe, num_inference_steps=1)
    workload = planner.last_workload
    key, peak, spare = planner._key(workload), planner.measured_peak(workload), planner.spare(workload)
    assert planner._store.graph_bytes(key) is None and peak > 0  # graphs off (a CPU): nothing recorded
    held = [0]
    monkeypatch.setattr(graphs.GraphCache, "nbytes", property(lambda self: held[0] if self is cache else 0))
    monkeypatch.setattr(graphs.GraphCache, "plan", _graphable_never_captured)
    cache.enabled = True
    run_wan(wan_pipe, num_inference_steps=1)
    assert planner._store.graph_bytes(key) == 0 and planner.measured_peak(workload) == peak
    assert planner.spare(workload) == spare - peak  # the eager peak left to the graphs to come
    held[0] = 3 * peak  # they hold more than the eager peak now (the scripted card's free memory is unchanged)
    assert planner.spare(workload) == spare
    run_wan(wan_pipe, num_inference_steps=1)
    assert planner._store.graph_bytes(key) == 3 * peak
    cache.waiting = 2 * peak  # a graph waits for that room to launch (`GraphCache._room_for`)
    run_wan(wan_pipe, num_inference_steps=1)
    assert planner._store.graph_bytes(key) == 5 * peak
    assert planner.spare(workload) == spare - 2 * peak  # the next plan leaves it that room
    engine.release(wan_pipe)


def _graphable_never_captured(self, owner, args, kwargs):
    """`GraphCache.plan` as for a GPU call that is never captured: counted as graphable, run eagerly."""
    self.described += 1


@pytest.fixture
def wan_pipe(tiny_wan_dir):
    return load_wan(tiny_wan_dir)


def _cores_kept(pipe, whole: bool, monkeypatch) -> tuple[torch.Tensor, int, list[int], int]:
    """One run with every block's core kept and its rest streamed through a ring of 3 buffers, the
    planner detached; ``whole``: a streaming block's call counts as graphable (a CUDA call would),
    so its units are bound at its entry (on the CPU no graph is made: the block runs eagerly).
    The output, the bytes copied, the order learned, and the blocks bound whole."""
    monkeypatch.setattr(graphs.GraphCache, "wants", lambda self, args, kwargs: whole)
    engine = Engine()
    engine.place(pipe, OffloadConfig(**BASE, preload="1000"))
    streamer = engine.states(pipe)["transformer"].transport
    streamer.events.unsubscribe("preload")
    streamer.set_resident({p.index for p in streamer.pieces if p.core})
    streamer.set_lookahead(3)
    bound_whole = []
    bind_whole = streamer._bind_whole
    streamer._bind_whole = lambda block, a, k: bind_whole(block, a, k) and not bound_whole.append(block.index)
    copied = streamer.prefetch.copied
    out = run_wan(pipe, num_inference_steps=1)
    copied = streamer.prefetch.copied - copied
    order = list(streamer.order.units)
    assert streamer.prefetch.bound == {} and streamer._whole == []
    engine.release(pipe)
    return out, copied, order, len(set(bound_whole))


def test_a_streaming_block_bound_whole_runs_its_parts_as_bound_one_by_one(tiny_wan_dir, monkeypatch) -> None:
    """A block in parts that streams its rest and is graphed whole has every unit bound at its
    entry and released at its exit: the same bits as binding part by part, each streamed unit
    copied once per forward, the execution order learned from the parts' own entries (not the
    binding order), and nothing left bound."""
    per_part = _cores_kept(load_wan(tiny_wan_dir), False, monkeypatch)
    whole = _cores_kept(load_wan(tiny_wan_dir), True, monkeypatch)
    assert per_part[3] == 0 and whole[3] > 0
    assert torch.equal(per_part[0], whole[0])
    assert whole[1] == per_part[1] > 0
    assert whole[2] == per_part[2]

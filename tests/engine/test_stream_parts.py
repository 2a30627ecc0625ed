"""Blocks streamed in parts (``stream_parts``): the same output as unplaced on every tiny pipeline,
no part weight read while it rests on the host, buffers sized to the largest part, and the
planner's slots counted in parts."""

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from fixtures.tiny_pipes import RUNNERS, run_wan
from torch.overrides import TorchFunctionMode

PARTS = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu", preload="off", stream_parts=True)


def _denoiser(engine, pipe):
    return engine.states(pipe)["transformer"].transport


class _HostReads(TorchFunctionMode):
    """Records every torch call that reads a part's weight while it is bound to its host copy:
    on a GPU that call would run on a CPU tensor (a device mismatch); on the CPU it only shows
    here."""

    def __init__(self, streamer) -> None:
        super().__init__()
        self.hosts = {id(s.tensor): s.host.data_ptr() for b in streamer.blocks if b.in_parts for s in b.slots}
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__get__", "__set__"):  # binding ``.data`` is no read
            return func(*args, **(kwargs or {}))
        for a in (*args, *(kwargs or {}).values()):
            if torch.is_tensor(a) and id(a) in self.hosts and a.data_ptr() == self.hosts[id(a)]:
                self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("name", "splits"), [("wan", True), ("flux", True), ("h3", True), ("ltx2", False)])
def test_parts_give_the_unplaced_output_and_no_part_is_read_from_the_host(name, splits, request):
    """LTX-2's blocks do not split: its audio branches are each under 1/8 of a block, so what
    would stay resident is large; they stream whole, in the same mode."""
    pipe = request.getfixturevalue(f"{name}_pipe")
    run = RUNNERS[name]
    expected = run(pipe, seed=0)
    engine = Engine()
    engine.place(pipe, PARTS)
    streamer = _denoiser(engine, pipe)
    assert all(b.in_parts == splits for b in streamer.blocks)
    watch = _HostReads(streamer)
    try:
        with watch:
            placed = run(pipe, seed=0)
    finally:
        engine.after_run(pipe)
    assert watch.reads == []
    torch.testing.assert_close(placed, expected, rtol=0, atol=0)
    engine.release(pipe)
    torch.testing.assert_close(run(pipe, seed=0), expected, rtol=0, atol=0)


def test_the_buffers_are_sized_to_the_largest_part_and_the_rest_stays_with_the_non_block_part(wan_pipe):
    whole = Engine()
    whole.place(wan_pipe, PARTS.replace(stream_parts=False))
    block_bytes, head = _denoiser(whole, wan_pipe).ring.slot_bytes, _denoiser(whole, wan_pipe).head_bytes()
    whole.release(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, PARTS)
    streamer = _denoiser(engine, wan_pipe)
    block = streamer.blocks[0]
    assert [type(u.module).__name__ for u in block.units] == ["WanAttention", "WanAttention", "FeedForward"]
    assert streamer.ring.slot_bytes == max(u.nbytes for u in block.units) < block_bytes
    assert streamer.head_bytes() == head + sum(b.rest_bytes for b in streamer.blocks) > head
    assert streamer.driver.planner.buffers.slot_sizes == {p.index: p.largest_unit for p in streamer.pieces}


def test_any_pieces_kept_in_parts_mode_give_the_unplaced_output(wan_pipe):
    """A block in parts is two pieces for the plan: its largest part (the core), then the rest;
    whole blocks, cores alone and rests alone may be kept."""
    ref = run_wan(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, PARTS)
    streamer = _denoiser(engine, wan_pipe)
    streamer.events.unsubscribe("preload")
    core, rest = streamer.pieces[:2]
    assert core.core and not rest.core and core.block is rest.block is streamer.blocks[0]
    assert core.units + rest.units == sorted(streamer.blocks[0].units, key=lambda u: u is not core.units[0])
    assert core.nbytes == max(u.nbytes for u in streamer.blocks[0].units)
    for kept in (streamer.pieces_of({0}), streamer.pieces_of({1}), {0}, {1}, {0, 3}, {0, 1, 2, 3}, set()):
        streamer.set_resident(kept)
        try:
            out = run_wan(wan_pipe)
        finally:
            engine.after_run(wan_pipe)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    engine.release(wan_pipe)


def test_an_oom_inside_a_part_gives_kept_blocks_up_and_the_block_runs_again(wan_pipe, monkeypatch):
    ref = run_wan(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, PARTS.replace(preload=40_000 / 2**30))  # one tiny block kept
    streamer = _denoiser(engine, wan_pipe)
    kept_before = streamer.resident_indices()
    assert kept_before
    inner, failures = wan_pipe.transformer.blocks[1].ffn.net[0], []  # inside the feed-forward part

    def fails_once(*args, **kwargs):
        if not failures:
            failures.append(args)
            raise torch.OutOfMemoryError("scripted: no room inside the feed-forward")
        return real(*args, **kwargs)

    real = inner.forward
    monkeypatch.setattr(inner, "forward", fails_once)
    try:
        out = run_wan(wan_pipe)
    finally:
        engine.after_run(wan_pipe)
    assert failures and streamer.resident_indices() < kept_before
    assert streamer.details()["ooms"] == 1
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_the_first_forward_guesses_each_blocks_parts_in_the_order_the_first_block_ran_them(h3_pipe):
    """H3's blocks register their modulation last and run it first. Before any cycle is recorded,
    the parts are guessed in registration order; once block 0 has run, the other blocks are
    guessed in its order, so their prefetches are not all misses in the first forward."""
    engine = Engine()
    engine.place(h3_pipe, PARTS)
    streamer = _denoiser(engine, h3_pipe)
    second = streamer.blocks[1]
    guesses: list[list[str]] = []

    def guess(module, args) -> None:
        mine = [streamer.units[i] for i in streamer.order.units if streamer.units[i].block is second]
        guesses.append([type(u.module).__name__ for u in mine])

    registered = [type(u.module).__name__ for u in second.units]
    handle = second.units[0].module.register_forward_pre_hook(guess)
    try:
        RUNNERS["h3"](h3_pipe, seed=0)
    finally:
        handle.remove()
        engine.after_run(h3_pipe)
    ran_first = "MiniMaxH3AdaLayerNormModulation"
    assert registered[-1] == ran_first  # the guess before block 0 ran would be wrong
    assert all(g[0] == ran_first and sorted(g) == sorted(registered) for g in guesses)
    engine.release(h3_pipe)

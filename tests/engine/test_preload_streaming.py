"""Preload on real hooks (tiny Wan, CPU): any resident set gives the same output, a set changed
mid-run stays correct, and an allocation failure gives kept blocks up and the step goes on."""

import logging

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.memory import MemoryReader
from diffusers_offload.offload_core.preload import planner as planner_module
from diffusers_offload.offload_core.preload.fit import MARGIN_BASE
from diffusers_offload.offload_core.preload.measures import MeasureStore
from diffusers_offload.offload_core.transport import streamer as streamer_module
from fixtures.tiny_pipes import run_wan

CFG = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, preload="off")


def _placed(pipe, config=CFG):
    engine = Engine()
    engine.place(pipe, config)
    return engine, engine.states(pipe)["transformer"].transport


def _run(engine, pipe, **kw):
    try:
        return run_wan(pipe, **kw)
    finally:
        engine.after_run(pipe)


@pytest.mark.parametrize("kept", [set(), {0}, {1}, {0, 1}, {2, 5, 8, 11}, set(range(12))])
def test_output_is_identical_for_every_resident_set(wan_pipe, kept):
    ref = run_wan(wan_pipe)
    engine, streamer = _placed(wan_pipe)
    streamer.events.unsubscribe("preload")  # hold the set by hand: no planner
    streamer.set_resident(kept)
    assert streamer.resident_indices() == kept
    torch.testing.assert_close(_run(engine, wan_pipe), ref, rtol=0, atol=0)


def test_resident_set_changed_between_steps_mid_run_stays_correct(wan_pipe):
    ref = run_wan(wan_pipe)
    engine, streamer = _placed(wan_pipe)
    streamer.events.unsubscribe("preload")
    sets = iter([{0}, {1}, {0, 1}, set()])
    seen = []

    def change(pipe, step, timestep, kwargs):
        target = next(sets)
        streamer.set_resident(target)
        seen.append(streamer.resident_indices())
        return kwargs

    out = _run(engine, wan_pipe, callback_on_step_end=change)
    assert seen == [{0}, {1}]  # two steps, two changes while the pipeline ran
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_fixed_budget_keeps_blocks_and_off_keeps_none(wan_pipe):
    block = max(b.nbytes for b in _placed(wan_pipe)[1].blocks)
    _, kept_one = _placed(wan_pipe, CFG.replace(preload=1.5 * block / 2**30))
    assert block <= kept_one.kept_bytes() <= 1.5 * block
    _, kept_none = _placed(wan_pipe, CFG.replace(preload="off"))
    assert kept_none.resident_indices() == set()


def _fails_once(real, failures: list, why: str):
    """``real``, except that its first call raises an OOM (recorded in ``failures``)."""

    def call(*args, **kwargs):
        if not failures:
            failures.append(args)
            raise torch.OutOfMemoryError(why)
        return real(*args, **kwargs)

    return call


def test_oom_in_a_block_buffer_gives_kept_blocks_up_and_the_step_goes_on(wan_pipe, monkeypatch):
    ref = run_wan(wan_pipe)
    block = max(b.nbytes for b in _placed(wan_pipe)[1].blocks)
    engine, streamer = _placed(wan_pipe, CFG.replace(preload=1.5 * block / 2**30))
    kept_before = streamer.resident_indices()
    assert kept_before
    failures = []  # in the denoiser's ring (a text encoder streamed from pinned memory has its own)
    monkeypatch.setattr(streamer.ring, "acquire",
                        _fails_once(streamer.ring.acquire, failures, "scripted: no room for the block buffer"))
    out = _run(engine, wan_pipe)
    assert failures, "the scripted OOM never fired"
    kept = streamer.resident_indices()
    assert kept < kept_before  # kept pieces were given up
    assert streamer.details()["kept_pieces"] == len(kept)
    assert streamer.details()["ooms"] == len(failures) == 1
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_oom_before_the_first_block_gives_kept_blocks_up_and_the_forward_runs_again(wan_pipe, monkeypatch):
    """A larger workload's first forward allocates its inputs before the first block, where its
    plan is made: an OOM there must not fail the step while kept blocks can go."""
    ref = run_wan(wan_pipe)
    block = max(b.nbytes for b in _placed(wan_pipe)[1].blocks)
    engine, streamer = _placed(wan_pipe, CFG.replace(preload=1.5 * block / 2**30))
    kept_before = streamer.resident_indices()
    assert kept_before
    embed, failures = wan_pipe.transformer.patch_embedding, []
    monkeypatch.setattr(embed, "forward", _fails_once(embed.forward, failures, "scripted: no room for the inputs"))
    out = _run(engine, wan_pipe)
    assert failures, "the scripted OOM never fired"
    assert streamer.resident_indices() < kept_before
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_a_forward_that_keeps_running_out_outside_the_blocks_is_not_retried_forever(wan_pipe, monkeypatch):
    """On the GPU every attempt refills the blocks copied ahead; dropping them is tried once."""
    engine, streamer = _placed(wan_pipe)
    calls = []

    def always_short(*args, **kwargs):
        calls.append(args)
        if len(calls) > 5:
            raise RuntimeError("retried without end")
        streamer.prefetch.inflight[1] = streamer.ring.acquire()  # what an attempt's prefetch leaves on a GPU
        raise torch.OutOfMemoryError("scripted: the card is full")

    monkeypatch.setattr(wan_pipe.transformer.patch_embedding, "forward", always_short)
    with pytest.raises(torch.OutOfMemoryError):
        _run(engine, wan_pipe)
    assert len(calls) == 2  # the call, and one retry without the prefetched blocks


def test_oom_with_nothing_left_to_give_up_is_raised(wan_pipe, monkeypatch):
    engine, streamer = _placed(wan_pipe)
    assert streamer.resident_indices() == set()

    def empty_failing(*args, **kwargs):
        raise torch.OutOfMemoryError("scripted: the card is full")

    monkeypatch.setattr(streamer_module.torch, "empty", empty_failing)
    with pytest.raises(torch.OutOfMemoryError):
        _run(engine, wan_pipe)
    monkeypatch.undo()
    ref_engine = Engine()
    ref_engine.release(wan_pipe)
    assert run_wan(wan_pipe).isfinite().all()  # released after the failure: the pipeline still works


def test_a_new_preload_policy_replans_in_place_without_rehooking(wan_pipe):
    engine, streamer = _placed(wan_pipe)
    hooks = [b.module._diffusers_hook.hooks for b in streamer.blocks]
    hook_objects = [dict(h) for h in hooks]
    block = max(b.nbytes for b in streamer.blocks)
    engine.place(wan_pipe, CFG.replace(preload=2.5 * block / 2**30))
    assert engine.states(wan_pipe)["transformer"].transport is streamer
    assert 2 * block <= streamer.kept_bytes() <= 2.5 * block  # the budget's pieces, re-planned in place
    assert [dict(b.module._diffusers_hook.hooks) for b in streamer.blocks] == hook_objects



class _Card(MemoryReader):
    """A card with ``free`` bytes on which a forward peaks at its weights plus ``activations``
    (set by the test before each run: all forwards of a run are one workload)."""

    def __init__(self, free: int) -> None:
        self.free, self.activations, self.streamer, self.retries = free, 0, None, 0

    def device_free(self, device):
        return (self.free, 0)

    def allocator_retries(self, device):
        return self.retries

    def peak_allocated(self, device):
        return self.streamer.weights_at_peak() + self.activations


def _on_a_card_watching_model_entry(pipe, monkeypatch):
    """Auto preload on a card with room for all tiny blocks beside about 1 MiB of activations,
    regrowing at once; returns (engine, card, streamer, the resident sets at each model entry)."""
    monkeypatch.setattr(planner_module, "growth_threshold", lambda largest: 0)
    card = _Card(free=MARGIN_BASE + 2**20)
    engine = Engine(memory=card)
    engine.place(pipe, CFG.replace(preload="auto"))
    card.streamer = streamer = engine.states(pipe)["transformer"].transport
    at_entry = []
    pipe.transformer.patch_embedding.register_forward_pre_hook(
        lambda module, args: at_entry.append(streamer.resident_indices()))
    return engine, card, streamer, at_entry


def test_a_known_larger_workload_gets_its_blocks_back_before_its_inputs_are_made(wan_pipe, monkeypatch):
    """Alternating workloads: the blocks the larger one's plan drops are given up when the model
    is entered, not at its first block, where its inputs are already made."""
    engine, card, streamer, at_entry = _on_a_card_watching_model_entry(wan_pipe, monkeypatch)
    small, large = {"height": 16, "width": 16}, {"height": 64, "width": 64}
    for activations, size in ((0, small), (2 * 2**20, large), (0, small), (2 * 2**20, large)):
        card.activations = activations
        at_entry.clear()
        _run(engine, wan_pipe, **size)
    assert at_entry[0] == set(), at_entry  # second large run: given up at entry


def test_a_larger_workload_seen_for_the_first_time_gives_blocks_up_before_its_inputs_are_made(wan_pipe, monkeypatch):
    """Its plan is unmeasured: estimated from the known workload's measure, scaled by how the
    model's inputs grew, and the blocks it drops go before the non-block part runs."""
    engine, card, streamer, at_entry = _on_a_card_watching_model_entry(wan_pipe, monkeypatch)
    card.activations = 128 * 2**10
    _run(engine, wan_pipe, height=16, width=16)
    assert streamer.resident_blocks() == set(range(len(streamer.blocks)))  # measured: all kept for the small one
    at_entry.clear()
    card.activations *= 16  # 64x64 has 16 times the tokens: 2 MiB, more than the room
    _run(engine, wan_pipe, height=64, width=64)
    assert at_entry[0] == set(), at_entry


def test_the_non_block_part_is_not_room_a_plan_may_reuse(wan_pipe, monkeypatch):
    """Kept blocks and streaming buffers can be reused by a new plan; the resident non-block
    part cannot, so it must not count as available."""
    engine = Engine(memory=_Card(free=0))
    engine.place(wan_pipe, CFG.replace(preload="auto"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    assert streamer.head_bytes() > 0
    monkeypatch.setattr(streamer, "device_bytes", lambda: streamer.head_bytes() + 4096)  # as on a GPU
    assert streamer.driver.reading().resident == 4096


class _FullCard(MemoryReader):
    """A card with no room left beyond what the engine already holds."""

    def device_available(self, device):
        return 0


def test_a_vae_moving_in_gets_kept_blocks_back_and_they_return_next_run(wan_pipe):
    """Kept blocks are sized to the denoiser's activations; the on-demand VAE entered after the
    denoiser needs them back, or its decode runs out of memory on a small card."""
    ref = run_wan(wan_pipe)
    engine = Engine(memory=_FullCard())
    engine.place(wan_pipe, CFG)
    streamer = engine.states(wan_pipe)["transformer"].transport
    engine.place(wan_pipe, CFG.replace(preload=1.5 * max(b.nbytes for b in streamer.blocks) / 2**30))
    assert engine.states(wan_pipe)["vae"].decision.role.value == "on-demand"
    kept = streamer.resident_indices()
    assert kept and streamer.kept_bytes() <= 1.5 * max(b.nbytes for b in streamer.blocks)
    during_decode = []
    wan_pipe.vae.decoder.register_forward_pre_hook(
        lambda module, args: during_decode.append(streamer.resident_indices()))
    torch.testing.assert_close(_run(engine, wan_pipe), ref, rtol=0, atol=0)
    assert during_decode and during_decode[0] == set()  # given back before the decode ran
    at_first_block = []
    wan_pipe.transformer.blocks[0].register_forward_hook(  # after the block: its cycle has begun
        lambda module, args, output: at_first_block.append(streamer.resident_indices()))
    _run(engine, wan_pipe)
    assert at_first_block[0] == kept  # the fixed budget's blocks are back for the next run


def test_an_allocator_retry_inside_a_forward_is_a_shortage_at_the_next_cycle(wan_pipe, monkeypatch):
    """PyTorch's flush-and-retry counter is a shortage signal: a retry during one forward gives
    kept pieces up at the next cycle and records a penalty."""
    engine, card, streamer, _ = _on_a_card_watching_model_entry(wan_pipe, monkeypatch)
    _run(engine, wan_pipe, height=16, width=16)  # measured: everything kept
    kept = streamer.resident_indices()
    planner = streamer.driver.planner
    assert kept and planner.penalty(planner.last_workload) == 0
    bumped = []

    def retry_once(module, args, output):
        if not bumped:
            bumped.append(1)
            card.retries += 1  # the allocator flushed its cache and retried during this forward

    wan_pipe.transformer.blocks[1].register_forward_hook(retry_once)
    _run(engine, wan_pipe, height=16, width=16)
    assert bumped and planner.penalty(planner.last_workload) > 0  # kept pieces were given up for it


def test_an_allocator_retry_gives_up_the_lookahead_buffer_before_kept_pieces(wan_pipe, monkeypatch, caplog):
    """On a card with room for the two block cores and three streaming buffers, the third
    buffer's retry costs that buffer: the pieces stay and the next runs keep them with the
    window's two buffers."""
    monkeypatch.setattr(planner_module, "growth_threshold", lambda largest: 0)
    monkeypatch.setattr(planner_module, "process_store", MeasureStore)  # no earlier test's penalty
    engine = Engine(memory=(card := _Card(free=0)))
    engine.place(wan_pipe, CFG.replace(preload="auto"))
    card.streamer = streamer = engine.states(wan_pipe)["transformer"].transport
    planner = streamer.driver.planner
    cores = [p for p in streamer.pieces if p.core]
    slot = max(p.largest_unit for p in streamer.pieces if not p.core)
    card.free = MARGIN_BASE + sum(p.nbytes for p in cores) + 3 * slot
    _run(engine, wan_pipe, height=16, width=16)
    kept = streamer.resident_indices()
    assert kept == {p.index for p in cores} and streamer.ring.capacity == 3
    bumped = []

    def retry_once(module, args, output):  # the allocator flushed its cache and retried in this forward
        if not bumped:
            bumped.append(1)
            card.retries += 1

    handle = wan_pipe.transformer.blocks[1].register_forward_hook(retry_once)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="diffusers_offload.preload"):
        _run(engine, wan_pipe, height=16, width=16)
    handle.remove()
    plans = [r.getMessage() for r in caplog.records if "blocks kept" in r.getMessage()]
    assert plans and all(f"{len(cores)} in part" in line for line in plans)  # no piece was given up
    assert "2 streaming buffers" in plans[-1] and streamer.ring.capacity == 2
    assert planner.penalty(planner.last_workload) == slot // 2  # the plan filled its budget: half the buffer
    _run(engine, wan_pipe, height=16, width=16)
    assert streamer.resident_indices() == kept and streamer.ring.capacity == 2


class _EntryCard(_Card):
    """A `_Card` that also reports ``live`` bytes of activations allocated (and not free): the
    test sets them while the non-block part's outputs exist."""

    def __init__(self, free: int) -> None:
        super().__init__(free)
        self.live = 0

    def device_free(self, device):
        return (self.free - self.live, 0)

    def allocated(self, device):
        return self.streamer.device_bytes() + self.live


@pytest.mark.parametrize("opening", [0, 1 << 20])
def test_the_non_block_part_outputs_are_not_counted_twice_at_the_cycle_start(wan_pipe, monkeypatch, opening):
    """At the first block the forward's inputs to it are allocated, and the workload's measure
    already holds them: the plan must be the one a forward without them would get."""
    monkeypatch.setattr(planner_module, "growth_threshold", lambda largest: 0)
    monkeypatch.setattr(planner_module, "process_store", MeasureStore)  # no earlier test's penalty
    card = _EntryCard(free=MARGIN_BASE + 2**20 + opening * 21 // 20)
    engine = Engine(memory=card)
    engine.place(wan_pipe, CFG.replace(preload="auto"))
    card.streamer = streamer = engine.states(wan_pipe)["transformer"].transport
    card.activations = 128 * 2**10 + opening
    wan_pipe.transformer.patch_embedding.register_forward_hook(lambda m, a, out: setattr(card, "live", opening))
    wan_pipe.transformer.proj_out.register_forward_hook(lambda m, a, out: setattr(card, "live", 0))
    for _ in range(2):
        _run(engine, wan_pipe, height=16, width=16)
    assert streamer.resident_blocks() == set(range(len(streamer.blocks)))


def test_a_decode_after_the_denoiser_is_not_measured_as_its_activations(wan_pipe, monkeypatch):
    """The denoiser's cycle closes when its forward returns: a VAE decode that peaks far above the
    denoiser, and retries the allocator while doing so, is neither its measure nor its shortage,
    so the second run keeps what the first kept (issue 24, first item)."""
    monkeypatch.setattr(planner_module, "process_store", MeasureStore)  # no earlier test's measure or penalty
    engine, card, streamer, at_entry = _on_a_card_watching_model_entry(wan_pipe, monkeypatch)
    planner = streamer.driver.planner
    card.activations = 128 * 2**10

    def decode_peaks(module, args):  # the allocator's peak stays there until the denoiser's next forward
        card.activations, card.retries = 64 * 2**20, card.retries + 1  # far beyond the card's room

    def denoiser_entered(module, args):
        card.activations = 128 * 2**10

    wan_pipe.vae.decoder.register_forward_pre_hook(decode_peaks)
    wan_pipe.transformer.register_forward_pre_hook(denoiser_entered)
    _run(engine, wan_pipe, height=16, width=16)
    first = streamer.resident_indices()
    measured = planner.measured_peak(planner.last_workload)
    assert first and measured < 2**20
    at_entry.clear()
    _run(engine, wan_pipe, height=16, width=16)
    assert at_entry and all(kept == first for kept in at_entry)
    assert streamer.resident_indices() == first
    assert planner.measured_peak(planner.last_workload) == measured
    assert planner.penalty(planner.last_workload) == 0


def test_a_model_may_supply_its_own_workload_function(wan_pipe, monkeypatch):
    """``offload_workload(args, kwargs)`` on the denoiser keys its cycles (the planner measures
    and plans per workload); without it, the largest input of the first block does."""
    engine, streamer = _placed(wan_pipe, CFG.replace(preload="auto"))
    calls = []
    monkeypatch.setattr(wan_pipe.transformer, "offload_workload",
                        lambda args, kwargs: calls.append(1) or 12345, raising=False)
    _run(engine, wan_pipe, height=16, width=16)
    assert calls and streamer.driver.planner.last_workload == 12345

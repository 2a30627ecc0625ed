"""The streaming buffer ring: buffers are reused, never more than its capacity are kept between
uses, each streamed unit is copied into the same one every forward, and a new resident set's
block size replaces them; a denoiser's stay from run to run and go last when room is asked, a text
encoder's go when the denoiser starts (CPU: the event logic needs a GPU and is checked by the
parity rows of bench/wan_bench.py)."""

import pytest
import torch
from diffusers_offload.offload_core import Components, Engine, OffloadConfig
from diffusers_offload.offload_core.transport.encoder_stream import EncoderStreamer
from diffusers_offload.offload_core.transport.ring import BufferRing
from fixtures.side_stream import stand_in_side_stream
from fixtures.tiny_pipes import run_wan

CPU = torch.device("cpu")


def test_a_released_slot_is_reused_instead_of_allocating_again():
    ring = BufferRing(CPU, capacity=2)
    ring.resize(1024)
    first = ring.acquire()
    ring.release(first, read_by_compute=True)
    assert ring.acquire().buf.data_ptr() == first.buf.data_ptr()


def test_a_slot_taken_beyond_capacity_is_freed_when_it_comes_back():
    ring = BufferRing(CPU, capacity=2)
    ring.resize(1024)
    slots = [ring.acquire() for _ in range(3)]
    assert ring.nbytes == 3 * 1024
    for slot in slots:
        ring.release(slot, read_by_compute=True)
    assert ring.nbytes == 2 * 1024


def test_resizing_drops_slots_of_the_old_size_and_clear_drops_the_idle_ones():
    ring = BufferRing(CPU, capacity=2)
    ring.resize(1024)
    busy, idle = ring.acquire(), ring.acquire()
    ring.release(idle, read_by_compute=False)
    ring.resize(512)  # a larger block became resident
    assert ring.nbytes == 512  # the busy one, until it comes back
    ring.release(busy, read_by_compute=True)
    assert ring.nbytes == 0
    assert ring.acquire().buf.numel() == 512


def test_a_slot_asked_for_by_its_number_is_that_buffer_and_a_smaller_ring_drops_the_higher_numbers():
    ring = BufferRing(CPU, capacity=3)
    ring.resize(1024)
    assert ring.fill() and ring.nbytes == 3 * 1024
    slots = {home: ring.acquire(home) for home in (2, 0, 1)}
    assert [slots[h].home for h in (0, 1, 2)] == [0, 1, 2]
    assert not ring.free_for(1)
    ring.release(slots[1], read_by_compute=True)
    ring.set_capacity(4)
    assert ring.free_for(3) and not ring.free_for(3, made_only=True)  # number 3 is not made yet
    ring.set_capacity(3)
    assert ring.free_for(1) and ring.acquire(1) is slots[1]
    beside = ring.acquire(0)  # every buffer busy: one beside them, dropped when it comes back
    assert beside.home == -1
    ring.release(beside, read_by_compute=True)
    for slot in slots.values():
        ring.release(slot, read_by_compute=True)
    assert ring.nbytes == 3 * 1024
    ring.set_capacity(2)
    assert ring.nbytes == 2 * 1024 and ring.acquire(2).home in (0, 1)  # number 2 is gone


def _count_block_buffers(monkeypatch, ring: BufferRing | None = None) -> list:
    """Record every flat block buffer allocated from now on (uint8 ``torch.empty`` calls); with
    ``ring``, only those inside its ``acquire`` (a text encoder streamed from pinned memory has a
    ring of its own)."""
    allocations = []
    real_empty = torch.empty
    inside = [] if ring is not None else [True]

    def counting_empty(*args, **kwargs):
        if inside and kwargs.get("dtype") is torch.uint8:
            allocations.append(args)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", counting_empty)
    if ring is not None:
        real_acquire = ring.acquire

        def acquire(*args, **kwargs):
            inside.append(True)
            try:
                return real_acquire(*args, **kwargs)
            finally:
                inside.pop()

        monkeypatch.setattr(ring, "acquire", acquire)
    return allocations


def test_a_run_allocates_one_block_buffer_which_the_next_run_reuses_until_room_is_asked(wan_pipe, monkeypatch):
    """The ring's buffers outlive a run (a remade buffer may land elsewhere, and streamed units'
    CUDA graphs are keyed by their buffer's address); asked for room, they go once no kept piece
    is left to give."""
    ref = run_wan(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, preload="off"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    allocations = _count_block_buffers(monkeypatch, streamer.ring)
    try:
        outs = []
        for _ in range(2):
            outs.append(run_wan(wan_pipe))  # 2 steps x 2 streamed blocks, no side stream on the CPU
            engine.after_run(wan_pipe)
            assert streamer.ring.nbytes == streamer.ring.slot_bytes > 0
        assert len(allocations) == 1
        slot = streamer.ring.slot_bytes
        needed = streamer.run_bytes()
        streamer.ring.clear()
        assert streamer.run_bytes() - needed == slot  # a held buffer is not asked for again
        streamer.events.unsubscribe("preload")  # the plan is set by hand
        streamer.set_resident({streamer.pieces[-1].index})
        run_wan(wan_pipe)
        engine.after_run(wan_pipe)
        kept = streamer.kept_bytes()
        assert kept > 0 and streamer.ring.nbytes == streamer.ring.slot_bytes
        assert engine.give_back(wan_pipe, 1) == kept  # a kept piece goes first, the buffer stays
        assert streamer.kept_bytes() == 0 and streamer.ring.nbytes == streamer.ring.slot_bytes
        assert engine.give_back(wan_pipe, 1) == slot  # nothing kept is left: the buffer goes
    finally:
        engine.release(wan_pipe)
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_the_encoders_buffers_and_non_layer_part_are_off_the_device_while_the_denoiser_runs(wan_pipe) -> None:
    """Its streaming buffers go when the denoiser starts, with its non-layer part: neither takes
    the denoiser's room (a denoiser's own buffers stay from run to run)."""
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, prompt_cache_gb=0))
    encoder = engine.states(wan_pipe)["text_encoder"].transport
    assert isinstance(encoder, EncoderStreamer)
    denoiser = engine.states(wan_pipe)["transformer"].transport
    seen: list[tuple[int, bool]] = []
    handle = wan_pipe.transformer.blocks[0].register_forward_pre_hook(
        lambda module, args: seen.append((encoder.ring.nbytes, encoder.head_loaded)))
    try:
        for _ in range(2):
            encoder.ring.fill()  # as a GPU would hold them after the encode
            run_wan(wan_pipe)
            engine.after_run(wan_pipe)
            assert encoder.ring.nbytes == 0 and not encoder.head_loaded
            assert denoiser.ring.nbytes > 0
    finally:
        handle.remove()
        engine.release(wan_pipe)
    assert seen and all(entry == (0, False) for entry in seen)


def _six_block_wan():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=6,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads").eval()
    for p in model.parameters():
        p.data.normal_(0, 0.5)  # random init leaves some weights zero: every block must matter
    feeds = {"hidden_states": torch.randn(1, 4, 2, 8, 8), "encoder_hidden_states": torch.randn(1, 5, 16),
             "timestep": torch.full((1,), 500.0), "return_dict": False}
    return model, feeds


def _forward(model, feeds):
    with torch.inference_mode():
        return model(**feeds)[0]


def _placed_with_side_stream(monkeypatch, parts: bool):
    """The six-block model, its unplaced output, and its streamer with the side stream stood in."""
    model, feeds = _six_block_wan()
    ref = _forward(model, feeds)
    engine = Engine()
    bag = Components(transformer=model)
    engine.place(bag, OffloadConfig(preload="off", resident_floor_mb=0, stream_parts=parts))
    streamer = engine.states(bag)["transformer"].transport
    stand_in_side_stream(monkeypatch, streamer)
    return model, feeds, ref, engine, bag, streamer


@pytest.mark.parametrize(("parts", "at_entry"), [(False, [1, 3]), (True, [1, 1])])
def test_prefetching_gives_the_resident_output_for_every_plan_and_a_new_plan_reuses_the_buffers(
        monkeypatch, parts, at_entry):
    """``at_entry``: the blocks of the units in flight when the model is entered again (two
    buffers: two whole blocks, or two parts of one). The last block fills one buffer fewer; the
    model's entry fills the other, before its non-block part runs."""
    model, feeds, ref, engine, bag, streamer = _placed_with_side_stream(monkeypatch, parts)
    streamer.events.unsubscribe("preload")  # the plans are set by hand
    streamer.set_resident(streamer.pieces_of({0, 2, 4}))
    torch.testing.assert_close(_forward(model, feeds), ref, rtol=0, atol=0)
    assert [streamer.units[i].block.index for i in streamer.prefetch.inflight] == at_entry[:1]
    seen = []
    handle = model.patch_embedding.register_forward_pre_hook(
        lambda module, args: seen.append([streamer.units[i].block.index for i in streamer.prefetch.inflight]))
    torch.testing.assert_close(_forward(model, feeds), ref, rtol=0, atol=0)
    handle.remove()
    assert seen == [at_entry]
    streamer.set_resident(set())  # block 0 now streams first: what is in flight is a wrong guess
    allocations = _count_block_buffers(monkeypatch)
    torch.testing.assert_close(_forward(model, feeds), ref, rtol=0, atol=0)
    assert allocations == []  # block 0 loaded into a wrong guess's buffer, not a third one
    assert streamer.ring.nbytes == 2 * streamer.ring.slot_bytes
    engine.release(bag)


@pytest.mark.parametrize("parts", [False, True])
def test_each_streamed_unit_is_copied_into_one_buffer_every_forward(monkeypatch, parts):
    """Three streamed blocks (whole, or in parts), two buffers: the buffers do not divide the
    streamed units, yet each unit is copied into the same buffer every forward (so its CUDA
    graph, keyed by that buffer's address, is captured once), and the output stays the resident
    one. Handed out as they came back, the units moved by one buffer a forward."""
    model, feeds, ref, engine, bag, streamer = _placed_with_side_stream(monkeypatch, parts)
    streamer.events.unsubscribe("preload")  # the plan is set by hand
    streamer.set_resident(streamer.pieces_of({0, 2, 4}))
    streamed = [u.index for u in streamer.units if u.piece.resident is None]
    assert streamer.ring.capacity == 2 and len(streamed) % 2 == 1
    buffers: dict[int, set[int]] = {}
    load = streamer.prefetch._load

    def recording_load(unit):
        slot = load(unit)
        buffers.setdefault(unit.index, set()).add(slot.buf.data_ptr())
        return slot

    monkeypatch.setattr(streamer.prefetch, "_load", recording_load)
    for _ in range(4):
        torch.testing.assert_close(_forward(model, feeds), ref, rtol=0, atol=0)
    assert sorted(buffers) == streamed and all(len(b) == 1 for b in buffers.values())
    assert len(set().union(*buffers.values())) == 2 and streamer.ring.nbytes == 2 * streamer.ring.slot_bytes
    engine.release(bag)


@pytest.mark.parametrize("parts", [False, True])
def test_a_units_views_of_a_buffer_are_made_once_and_later_forwards_make_none(monkeypatch, parts):
    """Building a unit's tensor views was most of the host time a streamed block cost; the ring's
    buffers live for the run, so each (buffer, unit) pair builds its views once."""
    from diffusers_offload.offload_core.transport.blocks import StreamUnit

    model, feeds, ref, engine, bag, streamer = _placed_with_side_stream(monkeypatch, parts)
    built = []
    real_views = StreamUnit.views
    monkeypatch.setattr(StreamUnit, "views", lambda unit, buf: built.append(unit.index) or real_views(unit, buf))
    outs = [_forward(model, feeds) for _ in range(2)]
    settled = len(built)  # each unit in its one buffer
    outs += [_forward(model, feeds) for _ in range(2)]
    assert 0 < settled <= len(streamer.units) and len(built) == settled
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    engine.release(bag)


def test_a_plan_that_changes_the_buffer_size_makes_the_buffers_then_not_mid_forward(monkeypatch):
    """A plan whose streamed units are of another size (a video plan streams 283 MB feed-forwards
    where an image plan streamed 210 MB attentions; here: none, then all) gets the ring's buffers
    of the new size at the plan change, between forwards, where no activations are live."""
    model, feeds, ref, engine, bag, streamer = _placed_with_side_stream(monkeypatch, True)
    streamer.events.unsubscribe("preload")  # the plans are set by hand
    streamer.set_resident({p.index for p in streamer.pieces})  # nothing streams: no buffers
    torch.testing.assert_close(_forward(model, feeds), ref, rtol=0, atol=0)
    assert streamer.ring.nbytes == 0
    streamer.set_resident(set())  # everything streams
    streamer.fill_ring()
    assert streamer.ring.nbytes == streamer.ring.capacity * streamer.ring.slot_bytes
    allocations = _count_block_buffers(monkeypatch)
    torch.testing.assert_close(_forward(model, feeds), ref, rtol=0, atol=0)
    assert allocations == []
    engine.release(bag)


def test_a_planned_load_makes_the_streaming_buffers_at_once(monkeypatch):
    model, feeds, ref, engine, bag, streamer = _placed_with_side_stream(monkeypatch, True)
    assert streamer.ring.nbytes == 0  # placed before the side stream was stood in
    streamer.driver.load()
    assert streamer.ring.nbytes == streamer.ring.capacity * streamer.ring.slot_bytes > 0
    engine.release(bag)

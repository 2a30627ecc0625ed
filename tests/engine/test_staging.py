"""Pinned staging buffers and partial pinning (issue 21.2, issue 24.7).

What runs here, on the CPU: the staging ring's layout and reuse (its device copy is then a plain
copy: a CPU has no streams and nothing is page-locked), the streamer's staged path with the side
stream stood in as in test_buffer_ring.py, the engine's decision of the copy path (a plain
function of the verdict and the device, asked for a CUDA device without needing one), and
partial pin budgets end to end (on a CPU device the grant is read and carried, nothing is
page-locked). The CUDA path (events, non-blocking copies from page-locked buffers) is checked by
bench/staging_check.py on the GPU.
"""

import logging

import pytest
import torch
from diffusers_offload.offload_core import Components, Engine, OffloadConfig
from diffusers_offload.offload_core.components import describe
from diffusers_offload.offload_core.memory import MemoryReader, PinVerdict
from diffusers_offload.offload_core.pin_path import transport_context
from diffusers_offload.offload_core.pinning import PinGrant
from diffusers_offload.offload_core.roles import Role, RoleDecision
from diffusers_offload.offload_core.transport.staging import StagingRing
from fixtures.side_stream import stand_in_side_stream
from fixtures.tiny_pipes import run_wan

CUDA = torch.device("cuda")  # only named: nothing is allocated on it


def _six_block_wan():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=6,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads").eval()
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    feeds = {"hidden_states": torch.randn(1, 4, 2, 8, 8), "encoder_hidden_states": torch.randn(1, 5, 16),
             "timestep": torch.full((1,), 500.0), "return_dict": False}
    return model, feeds


def _forward(model, feeds):
    with torch.inference_mode():
        return model(**feeds)[0]


def _refuse_direct_copy(pairs, pinned, after):
    raise AssertionError("an unpinned unit was copied straight from its pageable master, not staged")


# -- the staging ring itself ---------------------------------------------------------------------
def test_on_the_cpu_a_staged_unit_lands_in_its_flat_layout_bit_for_bit(wan_pipe):
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, preload="off"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    ring = StagingRing(stream=None)
    for unit in streamer.units:
        dst = torch.full((unit.nbytes,), 0xAB, dtype=torch.uint8)
        assert ring.copy(unit, dst, after=None) is None  # no stream: copied at once
        for view, slot in zip(unit.views(dst), unit.slots, strict=True):
            assert torch.equal(view, slot.host)
    assert ring.staged == len(streamer.units)
    engine.release(wan_pipe)


def test_the_ring_holds_its_count_of_buffers_of_the_largest_unit_and_reuses_them_in_turn(wan_pipe):
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, preload="off"))
    units = engine.states(wan_pipe)["transformer"].transport.units
    ring = StagingRing(stream=None, count=2)
    largest = max(u.nbytes for u in units)
    ring.resize(largest)
    for unit in units * 3:
        ring.copy(unit, torch.empty(unit.nbytes, dtype=torch.uint8), after=None)
    assert ring.nbytes == 2 * largest  # never more than its count, whatever was staged
    first = [b.buf.data_ptr() for b in ring._buffers]
    ring.copy(units[0], torch.empty(units[0].nbytes, dtype=torch.uint8), after=None)
    assert [b.buf.data_ptr() for b in ring._buffers] == first  # reused, not reallocated
    ring.clear()
    assert ring.nbytes == 0
    engine.release(wan_pipe)


# -- the streamer's staged path (side stream stood in) ----------------------------------------------
@pytest.mark.parametrize("parts", [False, True])
def test_on_the_cpu_staged_streaming_gives_the_unplaced_output_for_every_plan(monkeypatch, parts):
    model, feeds = _six_block_wan()
    ref = _forward(model, feeds)
    engine = Engine()
    bag = Components(transformer=model)
    engine.place(bag, OffloadConfig(preload="off", resident_floor_mb=0, stream_parts=parts, pin_memory=False))
    streamer = engine.states(bag)["transformer"].transport
    streamer.events.unsubscribe("preload")  # the plans are set by hand
    stand_in_side_stream(monkeypatch, streamer, _refuse_direct_copy)
    streamer.prefetch.staging = StagingRing(stream=None)  # the ring a side stream gets, copying at once
    assert not any(b.pinned for b in streamer.blocks)
    for kept in (set(), {0, 2, 4}, {1, 2, 3, 4, 5}):
        streamer.set_resident(streamer.pieces_of(kept))  # kept pieces are loaded through the ring too
        for _ in range(2):
            torch.testing.assert_close(_forward(model, feeds), ref, rtol=0, atol=0)
    assert streamer.prefetch.staging.staged >= len(streamer.units)
    assert streamer.details()["staged"] == streamer.prefetch.staging.staged
    streamer.after_run()
    assert streamer.prefetch.staging.nbytes > 0  # kept for the next run, like the streaming buffers
    streamer.give_back(2**40)  # more than the kept pieces: the buffers go too
    assert streamer.prefetch.staging.nbytes == 0  # given back with them
    engine.release(bag)


# -- the engine's choice of path ---------------------------------------------------------------------
def _transformer_info(wan_pipe):
    return describe("transformer", wan_pipe.transformer)


@pytest.mark.parametrize(("verdict_share", "pin_memory", "streams", "pin", "pin_bytes"), [
    (1.0, True, True, True, None),  # granted: pinned in place
    (0.5, True, True, True, "half"),  # partly: pinned up to the grant, the rest staged
    (0.0, True, True, False, None),  # denied: the side stream stays, everything staged
    (None, False, True, False, None),  # pin_memory off (or --disable-pinned-memory): staged
])
def test_a_streamed_denoiser_keeps_its_side_stream_whatever_the_pin_verdict(
        wan_pipe, caplog, verdict_share, pin_memory, streams, pin, pin_bytes):
    info = _transformer_info(wan_pipe)
    verdict = None if verdict_share is None else PinVerdict(
        need=info.nbytes, available=0, reserve=0, grant=int(info.nbytes * verdict_share))
    config = OffloadConfig(pin_memory=pin_memory)
    with caplog.at_level(logging.INFO, logger="diffusers_offload"):
        ctx = transport_context(info, RoleDecision(Role.PER_STEP, "denoiser"), config, CUDA, verdict,
                                MemoryReader(), None)
    assert (ctx.streams, ctx.pin) == (streams, pin)
    assert ctx.pin_bytes == (int(info.nbytes * 0.5) if pin_bytes == "half" else None)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("transformer:")]
    assert len(lines) == 1  # one line says which path was chosen
    assert ("staging buffers" in lines[0]) == (verdict_share != 1.0)


def test_leaf_groups_stream_only_on_a_full_grant(wan_pipe):
    """diffusers' leaf groups pin a copy of every weight themselves when streaming: a partial
    grant leaves them without streams."""
    info = _transformer_info(wan_pipe)
    decision = RoleDecision(Role.LEAF, "leaf mode")
    half = PinVerdict(need=info.nbytes, available=0, reserve=0, grant=info.nbytes // 2)
    full = PinVerdict(need=info.nbytes, available=0, reserve=0)
    assert not transport_context(info, decision, OffloadConfig(), CUDA, half, MemoryReader(), None).streams
    assert transport_context(info, decision, OffloadConfig(), CUDA, full, MemoryReader(), None).streams


def test_use_stream_off_stays_synchronous(wan_pipe):
    info = _transformer_info(wan_pipe)
    ctx = transport_context(info, RoleDecision(Role.PER_STEP, "denoiser"), OffloadConfig(use_stream=False), CUDA,
                            None, MemoryReader(), None)
    assert not ctx.streams


# -- partial pinning ------------------------------------------------------------------------------
def test_a_pin_grant_pins_a_prefix_of_the_blocks_in_table_order():
    grant = PinGrant(True, 250)
    assert [grant.claim(n) for n in (100, 100, 100, 10)] == [True, True, False, False]
    assert [PinGrant(True, None).claim(n) for n in (10**12, 1)] == [True, True]
    assert not PinGrant(False, None).claim(1)


class _Free(MemoryReader):
    def __init__(self, available: int) -> None:
        self.available = available

    def host_available(self) -> int:
        return self.available


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_on_the_cpu_partial_pin_budgets_give_identical_outputs(wan_pipe, share):
    """0 %, 50 % and 100 % of the transformer granted (free memory scripted): the grant is read
    and carried to the streamer; the output equals mode none's bit for bit."""
    ref = run_wan(wan_pipe)
    need = describe("transformer", wan_pipe.transformer).nbytes
    engine = Engine(memory=_Free(int(need * share) + 2**30))
    config = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, pin_reserve_gb=1.0, device="cpu")
    engine.place(wan_pipe, config)
    ctx = engine.states(wan_pipe)["transformer"].transport.ctx
    assert ctx.pin == (share > 0)
    assert ctx.pin_bytes == (int(need * share) if 0 < share < 1 else None)
    try:
        out = run_wan(wan_pipe)
    finally:
        engine.after_run(wan_pipe)
    engine.release(wan_pipe)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)

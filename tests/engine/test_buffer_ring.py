"""The streaming ring: bytes handed out tensor by tensor in the order units run, a piece not yet
read blocking the head, the copies waiting for the newest read of what they overwrite, one buffer
per run, and the copies running ahead by bytes rather than whole units (CPU: the streams' timing
needs a GPU and is measured by bench/step_profile.py and bench/wan_bench.py)."""

import pytest
import torch
from diffusers_offload.offload_core import Components, Engine, OffloadConfig
from diffusers_offload.offload_core.transport.ring import ALIGN, ByteRing
from fixtures.tiny_pipes import run_wan

CPU = torch.device("cpu")


def _ring(pieces: int) -> ByteRing:
    ring = ByteRing(CPU)
    ring.resize(pieces * ALIGN)
    return ring


def test_pieces_follow_one_another_and_one_not_read_yet_blocks_the_head():
    ring = _ring(4)
    a, b, c = (ring.take(ALIGN)[0] for _ in range(3))
    assert [a.start, b.start, c.start] == [0, ALIGN, 2 * ALIGN]
    assert ring.take(2 * ALIGN) is None  # wraps onto a and b, which are still to run
    read_a, read_b = object(), object()  # stand-ins for the compute stream's events
    ring.release([a], read_a)
    assert ring.take(2 * ALIGN) is None  # b is still in the way
    ring.release([b], read_b)
    piece, after = ring.take(2 * ALIGN)
    assert piece.start == 0 and after == [read_b]  # the newest read covers the older one


def test_the_end_left_behind_at_a_wrap_counts_as_in_the_way():
    """A tensor that does not fit before the end starts over at 0; what lies in the end it
    leaves behind is older than what lies at 0, so it must be done first (the order of reads)."""
    ring = _ring(8)
    a, b, c = (ring.take(2 * ALIGN)[0] for _ in range(3))
    d, _ = ring.take(ALIGN)  # [6, 7) of 8
    read_c, read_d, read_e = object(), object(), object()
    ring.release([a, b, c], read_c)
    e, after = ring.take(5 * ALIGN)  # no room after d: wraps over a, b, c
    assert e.start == 0 and after == [read_c]
    assert ring.take(4 * ALIGN) is None  # wraps again: d, in the end left behind, is not done
    ring.release([d], read_d)
    assert ring.take(4 * ALIGN) is None  # and e, at 0, is not done either
    ring.release([e], read_e)
    f, after = ring.take(4 * ALIGN)
    assert f.start == 0 and after == [read_e]


def test_a_view_is_the_piece_seen_as_the_tensor_and_resizing_drops_the_buffer():
    ring = _ring(4)
    host = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # not contiguous
    piece, _ = ring.take(host.numel() * host.element_size())
    view = ring.view(piece, host)
    view.copy_(host)
    assert view.shape == host.shape and torch.equal(view, host)
    assert view.untyped_storage().data_ptr() == ring.buf.untyped_storage().data_ptr()
    assert ring.resize(8 * ALIGN) and ring.nbytes == 0 and not ring.resize(8 * ALIGN)


def _count_block_buffers(monkeypatch) -> list:
    """Record every flat block buffer allocated from now on (uint8 ``torch.empty`` calls)."""
    allocations = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        if kwargs.get("dtype") is torch.uint8:
            allocations.append(args)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", counting_empty)
    return allocations


def test_a_run_allocates_one_ring_not_a_buffer_per_block_and_its_end_frees_it(wan_pipe, monkeypatch):
    ref = run_wan(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, preload="off"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    allocations = _count_block_buffers(monkeypatch)
    try:
        out = run_wan(wan_pipe)  # 2 steps x 2 streamed blocks, no side stream on the CPU
        assert streamer.ring.nbytes == streamer.ring.capacity == streamer.run_bytes()
    finally:
        engine.after_run(wan_pipe)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert len(allocations) == 1
    assert streamer.ring.nbytes == 0


class _SideStreamOnCpu:
    """Stands in for the CUDA side stream on the CPU: the streamer's prefetch bookkeeping (which
    blocks are in flight, in which buffer) runs as on a GPU; the copies happen at once."""


def _copy_now(pairs, pinned, after):
    for dst, src in pairs:
        dst.copy_(src)


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


def _placed_with_side_stream(monkeypatch, parts: bool, window: int = 1):
    """The six-block model, its unplaced output, and its streamer with the side stream stood in."""
    model, feeds = _six_block_wan()
    ref = _forward(model, feeds)
    engine = Engine()
    bag = Components(transformer=model)
    engine.place(bag, OffloadConfig(preload="off", resident_floor_mb=0, stream_parts=parts, prefetch_window=window))
    streamer = engine.states(bag)["transformer"].transport
    monkeypatch.setattr(streamer, "copy_stream", _SideStreamOnCpu())
    monkeypatch.setattr(streamer, "_copy", _copy_now)
    return model, feeds, ref, engine, bag, streamer




def _in_flight(streamer) -> dict[int, str]:
    """unit -> "whole" / "part" (some of its tensors copied ahead)."""
    return {i: "whole" if len(f.pieces) == len(streamer.units[i].slots) else "part"
            for i, f in streamer._inflight.items()}


@pytest.mark.parametrize(("parts", "in_flight"), [(False, {1: "whole", 3: "whole"}), (True, {3: "whole", 4: "whole"})])
def test_prefetching_gives_the_resident_output_for_every_plan_and_a_new_plan_reuses_the_ring(
        monkeypatch, parts, in_flight):
    """``in_flight``: the units copied ahead for the next forward (a ring of two blocks holds
    blocks 1 and 3; a ring of two parts, the first two parts of block 1)."""
    model, feeds, ref, engine, bag, streamer = _placed_with_side_stream(monkeypatch, parts)
    streamer.listeners.clear()  # the plans are set by hand
    streamer.set_resident({0, 2, 4})
    torch.testing.assert_close(_forward(model, feeds), ref, rtol=0, atol=0)
    assert _in_flight(streamer) == in_flight
    streamer.set_resident(set())  # block 0 now streams first: what is in flight is a wrong guess
    allocations = _count_block_buffers(monkeypatch)
    torch.testing.assert_close(_forward(model, feeds), ref, rtol=0, atol=0)
    assert allocations == []  # block 0 loaded into the ring, not into a buffer beside it
    assert streamer.ring.nbytes == streamer.run_bytes()
    engine.release(bag)


def test_the_copies_run_ahead_by_bytes_into_the_unit_that_does_not_fit_whole(monkeypatch):
    """A ring of three parts holds block 1's three smaller parts whole and the first tensors of
    block 3's first part (unit 9): copies no longer stop at the last unit that fits whole."""
    model, feeds, ref, engine, bag, streamer = _placed_with_side_stream(monkeypatch, parts=True, window=2)
    streamer.listeners.clear()
    streamer.set_resident({0, 2, 4})
    for _ in range(2):
        torch.testing.assert_close(_forward(model, feeds), ref, rtol=0, atol=0)
        assert _in_flight(streamer) == {3: "whole", 4: "whole", 5: "whole", 9: "part"}
    engine.release(bag)

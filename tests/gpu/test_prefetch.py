"""The streamer's copies at a forward's entry, on a CUDA device (a side stream; skipped in CI):
the first streamed units are queued into the buffers the ring holds before the planner's work at
the entry, so where the host waits for each step's end the copy engine does not wait for it; a
unit's small tensors copied as one pinned packet give the bits of each copied alone."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.transport import blocks
from fixtures.tiny_pipes import load_wan, run_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs a CUDA device")


def test_the_first_copies_are_queued_before_the_planner_runs_at_the_entry(tiny_wan_dir) -> None:
    pipe = load_wan(tiny_wan_dir)
    engine = Engine()
    engine.place(pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000"))
    streamer = engine.states(pipe)["transformer"].transport
    try:
        run_wan(pipe)
        streamer.events.unsubscribe("preload")
        streamer.set_resident(streamer.pieces_of({0}))  # every other block streams
        streamer.set_lookahead(3)
        run_wan(pipe)  # the ring's buffers are made
        seen: list[int] = []
        streamer.events.subscribe("probe", lambda event, source, **_: event == "forward" and seen.append(
            len(source.prefetch.inflight)) and False)
        run_wan(pipe)
        assert seen and all(n == streamer.ring.capacity for n in seen)
    finally:
        engine.release(pipe)



def _streamed_run(tiny_wan_dir) -> tuple[torch.Tensor, list]:
    pipe = load_wan(tiny_wan_dir)
    engine = Engine()
    engine.place(pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="off"))
    streamer = engine.states(pipe)["transformer"].transport
    try:
        assert all(b.pinned for b in streamer.blocks)
        packets = [u.packet for u in streamer.units]
        out = run_wan(pipe).cpu()
    finally:
        engine.release(pipe)
    assert not any(t.is_pinned() for t in pipe.transformer.parameters())
    assert all(u.packet is None for u in streamer.units)
    return out, packets


def test_pinned_units_copy_their_small_tensors_as_one_pinned_packet(tiny_wan_dir, monkeypatch) -> None:
    """Each unit's small tensors in one page-locked packet, one copy each: the same bits as each
    tensor copied alone; after release no weight of the model is page-locked."""
    packed, packets = _streamed_run(tiny_wan_dir)
    assert all(p is not None and p.is_pinned() for p in packets)
    monkeypatch.setattr(blocks, "PACK_BELOW", 0)
    alone, packets = _streamed_run(tiny_wan_dir)
    assert all(p is None for p in packets)
    assert torch.equal(packed, alone)

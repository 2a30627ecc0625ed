"""The preload driver's readings of the allocator on a CUDA device (skipped in CI): one table per
event of a forward (its start, its first block's cycle, its end), where each reading used to read
its own; the first two are on the launch path, where a synchronized step's copies wait for them."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig, memory
from fixtures.tiny_pipes import load_wan, run_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator's table needs a CUDA device")


def test_a_streamed_forward_reads_the_allocator_once_per_event(tiny_wan_dir, monkeypatch) -> None:
    pipe = load_wan(tiny_wan_dir)
    engine = Engine()
    engine.place(pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda"))
    streamer = engine.states(pipe)["transformer"].transport
    try:
        run_wan(pipe)  # measured, planned
        run_wan(pipe)
        reads: list[str] = []
        events: list[str] = []
        now: list[str | None] = [None]  # the event the listeners are handling (None: outside any)
        table = memory._allocator_stats
        monkeypatch.setattr(memory, "_allocator_stats", lambda device: reads.append(now[0]) or table(device))
        streamer.events.subscribe("probe", lambda event, source, **_: events.append(event) or now.__setitem__(0, event),
                                  first=True)
        streamer.events.subscribe("probe_end", lambda event, source, **_: now.__setitem__(0, None))  # after the driver
        run_wan(pipe)
        assert events.count("cycle") >= 2  # (a step's forwards)
        for event in ("forward", "cycle", "forward_end"):
            assert reads.count(event) == events.count(event), event
    finally:
        engine.release(pipe)

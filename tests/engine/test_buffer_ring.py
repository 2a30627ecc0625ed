"""The streaming buffer ring: buffers are reused, never more than its capacity are kept between
uses, and a new resident set's block size replaces them (CPU: the event logic needs a GPU and is
checked by the parity rows of bench/wan_bench.py)."""

import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.transport.ring import BufferRing
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


def test_a_run_allocates_one_block_buffer_not_one_per_block_and_its_end_frees_it(wan_pipe, monkeypatch):
    ref = run_wan(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, preload="off"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    allocations = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        if kwargs.get("dtype") is torch.uint8:  # flat block buffers
            allocations.append(args)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", counting_empty)
    try:
        out = run_wan(wan_pipe)  # 2 steps x 2 streamed blocks, no side stream on the CPU
        assert streamer.ring.nbytes == streamer.ring.slot_bytes
    finally:
        engine.after_run(wan_pipe)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert len(allocations) == 1
    assert streamer.ring.nbytes == 0

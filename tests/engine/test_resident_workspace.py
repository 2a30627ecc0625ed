"""A resident VAE's decode gets its working memory from the denoisers' kept blocks (found on the
H200: the tiny-by-size Wan VAE of a Wan 2.2 A14B pipeline at a 12 GiB cap ran out of memory in
its decode with both denoisers' blocks kept). The tiny Wan 2.2 A14B pipeline, its VAE resident
(under the on-demand threshold), each denoiser keeping blocks under a fixed preload budget."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.memory import MemoryReader
from diffusers_offload.offload_core.preload import planner as planner_module
from diffusers_offload.offload_core.preload.measures import MeasureStore
from diffusers_offload.offload_core.transport import workspace
from fixtures.tiny_pipes import load_wan_family, run_wan_family

DENOISERS = ("transformer", "transformer_2")


class _Card(MemoryReader):
    """``free`` bytes available; every call peaks ``peak`` bytes above its start."""

    def __init__(self, free: int, peak: int) -> None:
        self.free, self.peak = free, peak

    def device_available(self, device):
        return self.free

    def allocated(self, device):
        return 0

    def peak_allocated(self, device):
        return self.peak


@pytest.fixture
def a14b(tiny_wan_family, monkeypatch):
    monkeypatch.setattr(planner_module, "process_store", MeasureStore)  # keep no measures for later tests
    return load_wan_family(tiny_wan_family("wan22_a14b"))


def _placed(pipe, card: MemoryReader):
    engine = Engine(memory=card)
    cfg = OffloadConfig(on_demand_threshold_gb=1, resident_floor_mb=0, preload="off")
    engine.place(pipe, cfg)
    streamers = [engine.states(pipe)[n].transport for n in DENOISERS]
    largest = max(b.nbytes for s in streamers for b in s.blocks)
    engine.place(pipe, cfg.replace(preload=2.5 * largest / 2**30))
    assert engine.states(pipe)["vae"].decision.role.value == "resident"
    return engine, streamers


def _run(engine, pipe):
    try:
        return run_wan_family(pipe)
    finally:
        engine.after_run(pipe)


def _kept_at_decode(pipe, streamers, fail_once: bool = False) -> list[int]:
    """Kept bytes of both denoisers each time the VAE's decoder is entered; ``fail_once``: the
    first entry with blocks kept raises an out-of-memory error, as a full card would."""
    seen: list[int] = []

    def hook(module, args):
        kept = sum(s.kept_bytes() for s in streamers)
        seen.append(kept)
        if fail_once and kept and len(seen) == 1:
            raise torch.OutOfMemoryError("scripted: the card is full")

    pipe.vae.decoder.register_forward_pre_hook(hook)
    return seen


def test_an_out_of_memory_decode_runs_again_after_the_denoisers_give_their_kept_blocks_back(a14b, caplog):
    """The card reads room to spare, yet the first decode runs out: it runs again with every kept
    block given back, and so does the next run's decode before it is entered (its measure, taken
    with everything given back, would say the room to spare is enough)."""
    ref = run_wan_family(a14b)
    engine, streamers = _placed(a14b, _Card(free=1 << 40, peak=0))
    seen = _kept_at_decode(a14b, streamers, fail_once=True)
    with caplog.at_level("INFO", logger="diffusers_offload"):
        out = _run(engine, a14b)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert seen[0] > 0 and seen[1] == 0, seen  # the failed call with blocks kept, the repeat without
    assert "running it again" in caplog.text
    first_run = len(seen)
    torch.testing.assert_close(_run(engine, a14b), ref, rtol=0, atol=0)
    assert seen[first_run:] and not any(seen[first_run:]), seen  # the next run's decode asked for everything first
    engine.release(a14b)


def test_a_measured_decode_takes_its_room_before_it_runs(a14b):
    """Run 1 is unmeasured and fits; from run 2 the decode's measured peak is more than is free,
    so the kept blocks go before the decoder is entered (no error needed)."""
    ref = run_wan_family(a14b)
    engine, streamers = _placed(a14b, _Card(free=0, peak=4 << 20))
    seen = _kept_at_decode(a14b, streamers)
    torch.testing.assert_close(_run(engine, a14b), ref, rtol=0, atol=0)
    torch.testing.assert_close(_run(engine, a14b), ref, rtol=0, atol=0)
    assert seen[0] > 0 and seen[-1] == 0, seen
    engine.release(a14b)


def test_a_decode_that_fits_leaves_the_kept_blocks_alone(a14b):
    engine, streamers = _placed(a14b, _Card(free=1 << 40, peak=4 << 20))
    seen = _kept_at_decode(a14b, streamers)
    _run(engine, a14b)
    _run(engine, a14b)
    assert len(seen) >= 2 and min(seen) > 0, seen


def test_release_puts_the_vae_decode_back(a14b):
    engine, _streamers = _placed(a14b, _Card(free=0, peak=0))
    assert "decode" in vars(a14b.vae)
    engine.release(a14b)
    assert "decode" not in vars(a14b.vae) and "encode" not in vars(a14b.vae)


def test_a_measured_decode_that_still_ran_out_asks_for_everything_next_time(a14b, monkeypatch):
    """Found on the H200 under cudaMallocAsync: the measured room was given back and the decode
    still ran out (a fragmented pool); it ran again, and from then on that call takes everything."""
    monkeypatch.setattr(workspace, "MARGIN_BASE", 0)  # the tiny blocks: a 512 MiB margin would take them all
    ref = run_wan_family(a14b)
    engine, streamers = _placed(a14b, _Card(free=0, peak=1))
    seen: dict[int, list[int]] = {1: [], 2: [], 3: []}  # per run: kept bytes at each decoder entry
    run = [0]

    def hook(module, args):
        kept = sum(s.kept_bytes() for s in streamers)
        seen[run[0]].append(kept)
        if run[0] == 2 and kept and len(seen[2]) == 1:  # run 2's decode: its measured room was not enough
            raise torch.OutOfMemoryError("scripted: fragmented")

    a14b.vae.decoder.register_forward_pre_hook(hook)
    for i in (1, 2, 3):
        run[0] = i
        torch.testing.assert_close(_run(engine, a14b), ref, rtol=0, atol=0)
    full = seen[1][0]
    assert full > 0 and 0 < seen[2][0] < full, seen  # run 2 gave back its measured need only, then failed
    assert seen[2][1] == 0 and seen[3][0] == 0, seen  # its repeat, and run 3 from the start: everything
    engine.release(a14b)

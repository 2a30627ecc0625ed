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


class _Watch:
    """Per run (``run``, set by the test): the denoisers' kept bytes at each entry of the VAE's
    decoder (``at_decode``) and after their last forward (``after_denoise``); ``fail(run,
    entries)`` says where to raise an out-of-memory error, as a full card would."""

    def __init__(self, pipe, streamers, fail=lambda run, entries: False) -> None:
        self.run, self.at_decode, self.after_denoise = 0, {}, {}

        def decoder_entered(module, args):
            kept = sum(s.kept_bytes() for s in streamers)
            self.at_decode.setdefault(self.run, []).append(kept)
            if kept and fail(self.run, len(self.at_decode[self.run])):
                raise torch.OutOfMemoryError("scripted: the card is full")

        def denoised(module, args, out):
            self.after_denoise[self.run] = sum(s.kept_bytes() for s in streamers)

        pipe.vae.decoder.register_forward_pre_hook(decoder_entered)
        for name in DENOISERS:
            getattr(pipe, name).register_forward_hook(denoised)

    def runs(self, engine, pipe, ref, count: int) -> None:
        for self.run in range(1, count + 1):
            torch.testing.assert_close(_run(engine, pipe), ref, rtol=0, atol=0)


def test_an_unmeasured_decode_takes_everything_before_it_runs(a14b, caplog):
    """Run 1's decode is not measured: every kept block goes before it is entered (running short
    would cost a failed call and then the same). Run 2's is measured and fits: they stay."""
    ref = run_wan_family(a14b)
    engine, streamers = _placed(a14b, _Card(free=1 << 40, peak=4 << 20))
    watch = _Watch(a14b, streamers)
    with caplog.at_level("INFO", logger="diffusers_offload"):
        watch.runs(engine, a14b, ref, 2)
    assert watch.after_denoise[1] > 0 and not any(watch.at_decode[1]), watch.at_decode
    assert "is not measured yet" in caplog.text
    assert min(watch.at_decode[2]) == watch.after_denoise[2] > 0, (watch.at_decode, watch.after_denoise)
    assert engine.states(a14b)["vae"].transport.details() == {"ooms": 0}
    engine.release(a14b)


def test_a_measured_decode_takes_its_room_before_it_runs(a14b, monkeypatch):
    """From run 2 the decode's measured peak is more than is free: that much goes before the
    decoder is entered (no error needed), not everything."""
    monkeypatch.setattr(workspace, "MARGIN_BASE", 0)  # the tiny blocks: a 512 MiB margin would take them all
    ref = run_wan_family(a14b)
    engine, streamers = _placed(a14b, _Card(free=0, peak=1))
    watch = _Watch(a14b, streamers)
    watch.runs(engine, a14b, ref, 2)
    assert 0 < watch.at_decode[2][0] < watch.after_denoise[2], (watch.at_decode, watch.after_denoise)
    engine.release(a14b)


def test_release_puts_the_vae_decode_back(a14b):
    engine, _streamers = _placed(a14b, _Card(free=0, peak=0))
    assert "decode" in vars(a14b.vae)
    engine.release(a14b)
    assert "decode" not in vars(a14b.vae) and "encode" not in vars(a14b.vae)


def test_a_measured_decode_that_still_ran_out_asks_for_everything_next_time(a14b, monkeypatch):
    """Found on the H200 under cudaMallocAsync: the measured room was given back and the decode
    still ran out (a fragmented pool); it ran again with everything given back, and from then on
    that call takes everything before it runs."""
    monkeypatch.setattr(workspace, "MARGIN_BASE", 0)
    ref = run_wan_family(a14b)
    engine, streamers = _placed(a14b, _Card(free=0, peak=1))
    watch = _Watch(a14b, streamers, fail=lambda run, entries: run == 2 and entries == 1)
    watch.runs(engine, a14b, ref, 3)
    at, full = watch.at_decode, watch.after_denoise
    assert 0 < at[2][0] < full[2], (at, full)  # run 2 gave back its measured need only, then failed
    assert at[2][1] == 0 and full[3] > 0 and not any(at[3]), (at, full)  # its repeat, and run 3: everything
    assert engine.states(a14b)["vae"].transport.details() == {"ooms": 1}
    engine.release(a14b)

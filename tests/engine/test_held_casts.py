"""Kept fp8 pieces held as compute values (``transport/held_casts.py``), on the tiny Wan: the
output is the dequantised model's, bit for bit, held or not; held pieces take their compute bytes
and no cast runs for them; a shortage, a give-back and a weight write let them go (a shortage for
the rest of the run); a plan that streams holds none; nothing of ours stays after release."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import store_fp8
from diffusers_offload.offload_core.preload import PreloadPlanner
from diffusers_offload.offload_core.preload import planner as planner_module
from diffusers_offload.offload_core.preload.measures import MeasureStore
from diffusers_offload.offload_core.state import leftovers
from diffusers_offload.offload_core.transport import cast as cast_module
from diffusers_offload.offload_core.transport.held_casts import extra_bytes
from fixtures.scripted_memory import ScriptedCard
from fixtures.tiny_models import load_wan, run_wan

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


@pytest.fixture
def fp8_pipe(tiny_wan_dir):
    pipe = load_wan(tiny_wan_dir)
    pipe.transformer.to(torch.bfloat16)
    store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16)
    return pipe


def _stored(pipe) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}


def _unchanged(pipe, stored: dict[str, torch.Tensor]) -> bool:
    return all(p.dtype == stored[n].dtype and p.device.type == "cpu"
               and torch.equal(p.view(torch.uint8), stored[n].view(torch.uint8))
               for n, p in pipe.transformer.named_parameters())


def _placed(pipe, monkeypatch, spare: int):
    """Placed with every block kept (the planner gives ``spare`` bytes of room; the CPU has no
    memory readings to measure it from): the engine and the transformer's streamer."""
    monkeypatch.setattr(PreloadPlanner, "spare", lambda self, workload: spare)
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="auto", preload="1000", **BASE))
    return engine, engine.states(pipe)["transformer"].transport


def _casts(monkeypatch) -> list[int]:
    """Counts the unit casts from stored bytes (`cast.cast_into`) made from now."""
    calls = []
    real = cast_module.cast_into
    monkeypatch.setattr(cast_module, "cast_into", lambda *a: (calls.append(1), real(*a))[1])
    return calls


def test_held_pieces_give_the_same_bits_with_no_cast_and_release_clean(fp8_pipe, monkeypatch):
    stored = _stored(fp8_pipe)
    casts = _casts(monkeypatch)
    engine, streamer = _placed(fp8_pipe, monkeypatch, spare=0)
    plain = run_wan(fp8_pipe)
    engine.after_run(fp8_pipe)
    assert streamer.held.held == [] and len(casts) > 0  # a cast per fp8 unit per forward
    engine.release(fp8_pipe)

    casts.clear()
    engine, streamer = _placed(fp8_pipe, monkeypatch, spare=1 << 40)
    held = run_wan(fp8_pipe)
    engine.after_run(fp8_pipe)
    fp8_pieces = [p for p in streamer.pieces if any(u.cast for u in p.units)]
    assert len(streamer.held.held) == len(fp8_pieces) > 0
    stored_bytes = sum(p.nbytes for p in streamer.pieces)
    assert streamer.kept_bytes() == stored_bytes + streamer.details()["held_bytes"] > stored_bytes
    for piece in fp8_pieces:
        assert all(u.kept_views[0].dtype == torch.bfloat16 for u in piece.units if u.cast)
    again = run_wan(fp8_pipe)
    assert casts == []  # cast once, when held; never at a forward
    engine.release(fp8_pipe)
    assert torch.equal(held, plain) and torch.equal(again, plain)
    assert leftovers(fp8_pipe.transformer) == [] and _unchanged(fp8_pipe, stored)


def test_a_shortage_lets_them_go_for_the_rest_of_the_run(fp8_pipe, monkeypatch):
    engine, streamer = _placed(fp8_pipe, monkeypatch, spare=1 << 40)
    expected = run_wan(fp8_pipe)
    assert streamer.held.held
    assert streamer.driver.relieve(set())  # what an allocator retry or an out-of-memory error calls
    assert streamer.held.held == [] and streamer.details()["held_bytes"] == 0
    assert streamer.kept_bytes() == sum(p.nbytes for p in streamer.pieces)
    assert torch.equal(run_wan(fp8_pipe), expected)  # the same run goes on: none held again
    assert streamer.held.held == []
    engine.after_run(fp8_pipe)
    assert torch.equal(run_wan(fp8_pipe), expected) and streamer.held.held  # the next run holds again
    engine.release(fp8_pipe)


def test_a_give_back_and_a_weight_write_let_them_go_first(fp8_pipe, monkeypatch):
    engine, streamer = _placed(fp8_pipe, monkeypatch, spare=1 << 40)
    expected = run_wan(fp8_pipe)
    kept = streamer.resident_indices()
    extra = streamer.details()["held_bytes"]
    assert streamer.give_back(1) == extra and streamer.resident_indices() == kept  # no kept piece had to go
    run_wan(fp8_pipe)
    assert streamer.held.held
    streamer.before_write()
    assert streamer.held.held == []
    assert torch.equal(run_wan(fp8_pipe), expected)
    engine.release(fp8_pipe)


def test_a_plan_that_streams_holds_none(fp8_pipe, monkeypatch):
    engine, streamer = _placed(fp8_pipe, monkeypatch, spare=1 << 40)
    expected = run_wan(fp8_pipe)
    engine.after_run(fp8_pipe)
    assert streamer.held.held
    budget = sum(p.nbytes for p in streamer.pieces if p.block.index == 0)
    streamer.retune(OffloadConfig(mode="auto", preload=f"{budget / 2**30:.9f}", **BASE))  # some kept, the rest stream
    kept = streamer.resident_indices()
    assert 0 < len(kept) < len(streamer.pieces) and any(p.index in kept for p in streamer.held.held)
    assert torch.equal(run_wan(fp8_pipe), expected)
    assert streamer.held.held == []  # the pieces still kept are back in fp8
    assert streamer.kept_bytes() == sum(p.nbytes for p in streamer.pieces if p.index in kept)
    streamer.retune(OffloadConfig(mode="auto", preload="off", **BASE))  # every block streams
    assert torch.equal(run_wan(fp8_pipe), expected) and streamer.kept_bytes() == 0
    engine.release(fp8_pipe)


def test_room_for_some_holds_some_and_a_small_change_holds_still(fp8_pipe, monkeypatch):
    room = {"bytes": 0}
    engine, streamer = _placed(fp8_pipe, monkeypatch, spare=0)
    monkeypatch.setattr(PreloadPlanner, "spare", lambda self, workload: room["bytes"])
    one = max(extra_bytes(p) for p in streamer.pieces if any(u.cast for u in p.units))
    room["bytes"] = 3 * one
    expected = run_wan(fp8_pipe)
    assert 2 <= len(streamer.held.held) <= 3 and streamer.held.extra <= room["bytes"]
    held = list(streamer.held.held)
    room["bytes"] += one  # less than two pieces more: nothing changes
    assert torch.equal(run_wan(fp8_pipe), expected) and streamer.held.held == held
    room["bytes"] = 0  # more than one piece short: let go until they fit
    assert torch.equal(run_wan(fp8_pipe), expected) and streamer.held.held == []
    engine.release(fp8_pipe)


def test_the_planners_spare_room_holds_them(fp8_pipe, monkeypatch):
    """Through the planner's own reading (a scripted card with room to spare): the pieces are held
    once a forward is measured, and the next run finds them held."""
    monkeypatch.setattr(planner_module, "process_store", MeasureStore)  # no earlier test's measures
    monkeypatch.setattr(planner_module, "growth_threshold", lambda largest: 0)  # tiny blocks are kept
    engine = Engine(memory=ScriptedCard())
    engine.place(fp8_pipe, OffloadConfig(mode="auto", preload="auto", **BASE))
    streamer = engine.states(fp8_pipe)["transformer"].transport
    expected = run_wan(fp8_pipe)
    engine.after_run(fp8_pipe)
    assert len(streamer.resident_indices()) == len(streamer.pieces) and streamer.held.held
    held = list(streamer.held.held)
    assert torch.equal(run_wan(fp8_pipe), expected) and streamer.held.held == held
    engine.release(fp8_pipe)

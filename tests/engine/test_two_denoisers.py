"""Two denoisers, one VRAM budget (issue 24 item 2, SPEC §13): the tiny Wan 2.2 A14B pipeline
(``transformer`` above the boundary timestep, ``transformer_2`` below it) on a scripted card on
which both denoisers' plans do not fit at once. When one starts, the idle one gives its kept
blocks back, the whole need in one call, and the starting one keeps what it planned; the output
stays bit-exact, run 2 keeps what run 1 kept, nothing stays after release."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.memory import MemoryReader
from diffusers_offload.offload_core.preload import planner as planner_module
from diffusers_offload.offload_core.preload import shared as shared_module
from diffusers_offload.offload_core.preload.fit import margin
from diffusers_offload.offload_core.preload.measures import MeasureStore
from fixtures.tiny_pipes import load_wan_family, run_wan_family

AUTO = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, preload="auto")
NAMES = ("transformer", "transformer_2")
ACTIVATIONS = 64 << 10


class _Card(MemoryReader):
    """A card of ``capacity`` bytes holding both denoisers' device bytes; a forward peaks at the
    running denoiser's weights plus ``ACTIVATIONS`` beside what the other holds."""

    def __init__(self) -> None:
        self.capacity, self.streamers, self.running = 0, [], None

    def device_free(self, device):
        return (self.capacity - self.allocated(device), 0)

    def allocated(self, device):
        return sum(s.device_bytes() for s in self.streamers)

    def peak_allocated(self, device):
        running = self.running
        return self.allocated(device) - running.device_bytes() + running.weights_at_peak() + ACTIVATIONS

    def allocator_retries(self, device):
        return 0


@pytest.fixture
def a14b(tiny_wan_family):
    return load_wan_family(tiny_wan_family("wan22_a14b"))


def _placed(pipe, monkeypatch, room_margin: int = 0):
    """The pipeline placed on the card, whose capacity holds one denoiser's whole plan and half
    the other's; returns (engine, card, {name: streamer}). The 512 MiB room margin would take
    every tiny block: ``room_margin`` stands in for it at the tiny models' scale."""
    monkeypatch.setattr(planner_module, "growth_threshold", lambda largest: 0)  # tiny blocks regrow
    monkeypatch.setattr(planner_module, "process_store", MeasureStore)  # no earlier test's measures
    monkeypatch.setattr(shared_module, "ROOM_MARGIN", room_margin)
    card = _Card()
    engine = Engine(memory=card)
    engine.place(pipe, AUTO)
    streamers = {n: engine.states(pipe)[n].transport for n in NAMES}
    for streamer in streamers.values():  # as on a GPU: the non-block part and kept pieces are on the device
        monkeypatch.setattr(streamer, "device_bytes", lambda s=streamer: s.head_bytes() + s.kept_bytes())
        streamer.events.subscribe("card", lambda event, source, **_: _runs(card, event, source), first=True)
    card.streamers = list(streamers.values())
    whole = max(sum(p.nbytes for p in s.pieces) for s in streamers.values())
    heads = sum(s.head_bytes() for s in streamers.values())
    card.capacity = heads + ACTIVATIONS + margin(ACTIVATIONS) + whole + whole // 2
    return engine, card, streamers


def _runs(card: _Card, event: str, source) -> bool:
    if event == "forward":
        card.running = source
    return False


def _watch(streamers, monkeypatch):
    """Records each `take_idle` (who starts, the need, what was freed, give_back calls on the
    idle one, its kept bytes before and after) and each cycle's resident set against its plan."""
    takes, cycles, calls = [], [], {n: 0 for n in NAMES}
    for name, streamer in streamers.items():
        real = streamer.give_back

        def counted(nbytes, name=name, real=real):
            calls[name] += 1
            return real(nbytes)

        def probe(event, source, name=name, **_info):
            if event == "cycle":  # after the driver: the cycle's plan is applied
                cycles.append((name, source.resident_indices(), set(source.driver.planner.resident)))
            return False

        monkeypatch.setattr(streamer, "give_back", counted)
        streamer.events.subscribe("probe", probe)
    real_take = shared_module.SharedBudget.take_idle

    def take(self, running, need, why):
        before = {n: (calls[n], s.kept_bytes()) for n, s in streamers.items()}
        freed = real_take(self, running, need, why)
        starter = next(n for n, s in streamers.items() if s is running)
        idle = next(n for n in NAMES if n != starter)
        takes.append((starter, need, freed, calls[idle] - before[idle][0], before[idle][1],
                      streamers[idle].kept_bytes()))
        return freed

    monkeypatch.setattr(shared_module.SharedBudget, "take_idle", take)
    return takes, cycles


def _kept_at_last_cycle(cycles, name):
    return next(resident for n, resident, _plan in reversed(cycles) if n == name)


def _smallest_piece(pipe) -> int:
    """The smallest piece either denoiser streams, placed once to read it."""
    engine = Engine()
    engine.place(pipe, AUTO)
    try:
        return min(p.nbytes for n in NAMES for p in engine.states(pipe)[n].transport.pieces)
    finally:
        engine.release(pipe)


@pytest.mark.parametrize("with_margin", [False, True], ids=["margin 0", "margin one piece"])
def test_the_idle_denoiser_gives_room_to_the_starting_one_in_one_call(a14b, monkeypatch, with_margin):
    expected = run_wan_family(a14b)  # unplaced: what mode none runs
    room_margin = _smallest_piece(a14b) if with_margin else 0
    engine, card, streamers = _placed(a14b, monkeypatch, room_margin)
    largest = max(p.nbytes for s in streamers.values() for p in s.pieces)
    takes, cycles = _watch(streamers, monkeypatch)

    runs, kept_after = [], []
    for _ in range(2):
        takes.clear(), cycles.clear()
        runs.append(run_wan_family(a14b))
        engine.after_run(a14b)
        kept_after.append({n: _kept_at_last_cycle(cycles, n) for n in NAMES})
        needed = [t for t in takes if t[1] > 0]
        # each denoiser, when it started after the other, needed room the other held
        assert {t[0] for t in needed} == ({"transformer_2"} if len(runs) == 1 else set(NAMES)), takes
        for starter, need, freed, give_backs, idle_before, idle_after in needed:
            assert give_backs == 1, (starter, takes)  # the whole need at once, not piece by piece
            assert freed >= need + room_margin and idle_before - idle_after == freed, (starter, takes)
            assert freed < need + room_margin + largest, (starter, takes)  # no piece beyond the ask
            assert idle_after > 0, (starter, takes)  # only what was needed: lowest-ranked, not all
        for name, resident, plan in cycles:
            assert resident == plan, (name, cycles)  # every cycle runs with what its planner chose
        for name in NAMES:  # the last cycle of each kept its whole plan: every piece
            assert _kept_at_last_cycle(cycles, name) == set(range(len(streamers[name].pieces))), cycles

    assert kept_after[1] == kept_after[0]  # run 2 keeps what run 1 kept, per denoiser
    for frames in runs:
        assert torch.equal(frames, expected)
    engine.release(a14b)
    assert engine.states(a14b) == {}
    assert all(s.kept_bytes() == 0 and not s.pieces for s in streamers.values())
    assert all(p.device.type == "cpu" for n in NAMES for p in getattr(a14b, n).parameters())


def test_a_shortage_in_one_denoiser_takes_the_idle_ones_blocks_before_its_own(a14b, monkeypatch):
    """An allocation failure inside ``transformer_2``'s block: ``transformer``'s kept pieces go
    (one call), ``transformer_2`` keeps its own, and the step goes on to the same output."""
    expected = run_wan_family(a14b)
    engine, card, streamers = _placed(a14b, monkeypatch)
    card.capacity *= 4  # room for both plans: nothing is taken at the start
    run_wan_family(a14b)
    engine.after_run(a14b)
    idle, running = streamers["transformer"], streamers["transformer_2"]
    assert idle.kept_bytes() > 0 and running.kept_bytes() > 0
    own, block = running.resident_indices(), max(running.driver.planner.buffers.slot_sizes.values())
    takes, _cycles = _watch(streamers, monkeypatch)
    relieved = []

    def fail_once(module, args):
        if not relieved:
            relieved.append((running.relieve_in(running.blocks[0]), running.resident_indices()))

    handle = a14b.transformer_2.blocks[0].register_forward_pre_hook(fail_once)
    try:
        frames = run_wan_family(a14b)
    finally:
        handle.remove()
        engine.after_run(a14b)
    engine.release(a14b)

    assert relieved == [(True, own)]  # relieved, none of its own pieces given up
    shortage = [t for t in takes if t[0] == "transformer_2" and t[2] > 0]
    assert len(shortage) == 1 and shortage[0][3] == 1, takes  # one give_back on the idle one
    assert shortage[0][2] >= block  # the need: one streamed block
    assert torch.equal(frames, expected)


def test_the_idle_denoisers_streaming_buffers_are_room_given_after_its_kept_blocks(a14b, monkeypatch):
    """Each denoiser's streaming buffers stay from run to run; while it is idle they count as
    room the running one may take (`SharedBudget.idle_room`), and go only after its kept pieces."""
    monkeypatch.setattr(shared_module, "ROOM_MARGIN", 0)  # 512 MiB would take everything tiny
    expected = run_wan_family(a14b)  # unplaced
    engine = Engine()
    engine.place(a14b, AUTO.replace(preload="off"))  # everything streams: both hold buffers after a run
    run_wan_family(a14b)
    engine.after_run(a14b)
    idle, running = (engine.states(a14b)[n].transport for n in NAMES)
    budget = running.driver.shared
    idle.set_resident({idle.pieces[-1].index})  # and the idle one keeps a piece
    kept, buffers = idle.kept_bytes(), idle.ring.nbytes
    assert buffers > 0 and budget.idle_room(running) == kept + buffers
    assert budget.take_idle(running, max(kept, 1), "test") >= kept  # kept pieces first ...
    assert idle.kept_bytes() == 0 and idle.ring.nbytes == buffers  # ... the buffers stay
    assert budget.take_idle(running, 1, "test") == buffers and idle.ring.nbytes == 0  # then they go
    assert torch.equal(run_wan_family(a14b), expected)  # the buffers are made again where needed
    engine.after_run(a14b)
    engine.release(a14b)

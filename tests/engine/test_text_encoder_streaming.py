"""Text encoders streamed from pinned memory (SPEC §2, §13) on the tiny Wan (UMT5), Flux (CLIP +
T5), LTX-2 (Gemma 3) and MiniMax-H3 (Qwen3-VL) pipelines, real diffusers/transformers code, CPU.

What must hold: with the pin granted a text encoder's layers go through the block streamer (the
report says so) and with it denied they stay on leaf groups, as before; the outputs equal mode
none bit for bit, run after run and after a LoRA change; the release leaves nothing of ours and
nothing pinned; the denoiser's preload planner never sees the encoder's activity; an interrupt
inside the text encode stops before the next layer and the next run is right; a forward that
stops early, or calls the inner model, never makes the streamer learn a wrong order or raise.

The tiny CLIP and Gemma 3 are mostly embedding table (their layers are 41 % and 27 % of their
bytes), so by the default rule they are not streamed (a report test checks that); the parity
tests lower the share (`encoder_stream.MIN_TOWER_SHARE`) so that every encoder's layers stream
(real CLIP-L and Gemma 3 12B are ~70 % and ~90 % layers).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.components import iter_modules
from diffusers_offload.offload_core.lora import LoraSpec, activate
from diffusers_offload.offload_core.memory import MemoryReader
from diffusers_offload.offload_core.pinning import pinned_bytes
from diffusers_offload.offload_core.run.stages import TEXT, StageHooks, StageHost, layer_stack
from diffusers_offload.offload_core.state import PLANNER, leftovers
from diffusers_offload.offload_core.transport import encoder_stream
from diffusers_offload.offload_core.transport.encoder_stream import EncoderStreamer
from fixtures.tiny_pipes import run_flux, run_h3, run_ltx2, run_wan

CFG = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu", prompt_cache_gb=0)  # every run encodes
RUN = {"wan_pipe": run_wan, "flux_pipe": run_flux, "ltx2_pipe": run_ltx2, "h3_pipe": run_h3}
ENCODERS = {"wan_pipe": ("text_encoder",), "flux_pipe": ("text_encoder", "text_encoder_2"),
            "ltx2_pipe": ("text_encoder",), "h3_pipe": ("text_encoder",)}
STREAMED = "text encoder: layers streamed from pinned memory"
LESSER = "text encoder: pin granted, its layers under half of it: leaf groups"
DEFAULT_REASONS = {("wan_pipe", "text_encoder"): STREAMED, ("flux_pipe", "text_encoder"): LESSER,
                   ("flux_pipe", "text_encoder_2"): STREAMED, ("ltx2_pipe", "text_encoder"): LESSER,
                   ("h3_pipe", "text_encoder"): STREAMED}


class NoRoomToPin(MemoryReader):
    """A host with no free memory: the pin budget denies every component."""

    def host_available(self) -> int:
        return 0


class Interrupted(BaseException):
    """Stands in for ComfyUI's InterruptProcessingException."""


@pytest.fixture
def every_layer_stack_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoder_stream, "MIN_TOWER_SHARE", 0.25)


def _streamers(engine: Engine, pipe: object, names: tuple[str, ...]) -> dict[str, EncoderStreamer]:
    found = {n: engine.states(pipe)[n].transport for n in names}
    assert all(isinstance(t, EncoderStreamer) for t in found.values()), found
    return found


def _count_entries(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(id of the encoder streamer, unit index) for every layer an encoder streamer binds."""
    entered: list[tuple[int, int]] = []
    real = EncoderStreamer.enter
    monkeypatch.setattr(EncoderStreamer, "enter", lambda self, unit, *call: entered.append((id(self), unit.index))
                        or real(self, unit, *call))
    return entered


def _same(a: object, b: object) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- the role decision ------------------------------------------------------------------------
@pytest.mark.parametrize("pipe_name", list(RUN))
def test_granted_streams_the_layers_and_denied_keeps_leaf_groups(pipe_name, request) -> None:
    pipe = request.getfixturevalue(pipe_name)
    denied_engine = Engine(memory=NoRoomToPin())
    denied = denied_engine.place(pipe, CFG)
    for name in ENCODERS[pipe_name]:
        assert (denied.component(name).role, denied.component(name).reason) == ("leaf", "text encoder")
        assert denied_engine.states(pipe)[name].transport.name == "leaf"
    denied_engine.release(pipe)
    engine = Engine()  # the live reading: this host grants a tiny encoder
    granted = engine.place(pipe, CFG)
    for name in ENCODERS[pipe_name]:
        component, transport = granted.component(name), engine.states(pipe)[name].transport
        assert (component.role, component.reason) == ("leaf", DEFAULT_REASONS[pipe_name, name])
        assert isinstance(transport, EncoderStreamer) == (component.reason == STREAMED)
        if component.reason == STREAMED:  # whole layers: one unit per layer of its stack
            assert component.details["blocks"] == component.details["units"] == len(layer_stack(getattr(pipe, name)))
    engine.release(pipe)


def test_a_partial_grant_streams_the_layers_partly_pinned_and_runs_like_mode_none(wan_pipe) -> None:
    """A host short of RAM grants part of the encoder (found on the H200: H3's 62 GiB Qwen3-VL
    granted 38 GiB fell back to leaf groups from pageable memory, 55 s a run): its layers still
    go through the streamer, pinned up to the grant, the rest through the staging buffers."""
    engine = Engine()
    engine.place(wan_pipe, CFG.replace(mode="none"))
    reference = run_wan(wan_pipe)
    engine.release(wan_pipe)
    half = wan_pipe.text_encoder.get_memory_footprint() // 2
    report = engine.place(wan_pipe, CFG.replace(host_ram_gb=half / 2**30))
    streamer = _streamers(engine, wan_pipe, ("text_encoder",))["text_encoder"]
    assert streamer.ctx.pin_bytes is not None and 0 < streamer.ctx.pin_bytes <= half + 1
    assert "layers streamed, " in report.component("text_encoder").reason
    assert "the rest through pinned staging buffers" in report.component("text_encoder").reason
    try:
        _same(run_wan(wan_pipe), reference)
    finally:
        engine.after_run(wan_pipe)
    engine.release(wan_pipe)
    assert leftovers(wan_pipe.text_encoder) == []


def test_a_lowered_share_streams_clip_and_gemma_too(flux_pipe, ltx2_pipe, every_layer_stack_streams) -> None:
    for pipe, names in ((flux_pipe, ("text_encoder", "text_encoder_2")), (ltx2_pipe, ("text_encoder",))):
        engine = Engine()
        report = engine.place(pipe, CFG)
        assert [report.component(n).reason for n in names] == [STREAMED] * len(names)
        _streamers(engine, pipe, names)
        engine.release(pipe)


# -- outputs, runs, release ---------------------------------------------------------------------
@pytest.mark.parametrize("pipe_name", list(RUN))
def test_streamed_outputs_equal_mode_none_run_after_run_and_nothing_is_left(
        pipe_name, request, monkeypatch, every_layer_stack_streams) -> None:
    pipe, run = request.getfixturevalue(pipe_name), RUN[pipe_name]
    engine = Engine()
    engine.place(pipe, CFG.replace(mode="none"))
    reference = run(pipe)
    engine.release(pipe)
    engine.place(pipe, CFG)
    streamers = _streamers(engine, pipe, ENCODERS[pipe_name])
    entered = _count_entries(monkeypatch)
    for _ in range(2):
        try:
            out = run(pipe)
        finally:
            engine.after_run(pipe)
        _same(out, reference)
        for streamer in streamers.values():  # every layer went through the streamer, in every call
            bound = [u for s, u in entered if s == id(streamer)]
            assert bound and set(bound) == set(range(len(streamer.units)))
            assert sorted(streamer.order.units) == list(range(len(streamer.units)))
        entered.clear()
    engine.release(pipe)
    for name, module in iter_modules(pipe):
        assert leftovers(module) == [], name
    assert pinned_bytes() == 0  # on a CPU-only torch nothing is ever page-locked: with CUDA this is the check


def test_a_run_after_a_lora_change_on_a_streamed_encoder_is_right(
        flux_pipe, tmp_path: Path, every_layer_stack_streams) -> None:
    """A LoRA on Flux's CLIP (the only text encoder diffusers' Flux loader takes one for): written
    into the streamed layers' host masters, changed, removed; each run equals the unplaced pipeline
    with the same set."""
    from diffusers import FluxPipeline
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    model = copy.deepcopy(flux_pipe.text_encoder)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    inject_adapter_in_model(config, model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    FluxPipeline.save_lora_weights(tmp_path, text_encoder_lora_layers=get_peft_model_state_dict(model))
    path = str(tmp_path / "pytorch_lora_weights.safetensors")
    sets = {"base": [], "full": [LoraSpec(path, 1.0)], "half": [LoraSpec(path, 0.5)]}
    references = {}
    for key, specs in sets.items():
        activate(flux_pipe, specs)
        references[key] = run_flux(flux_pipe)
    assert not torch.equal(references["full"], references["base"])
    activate(flux_pipe, [])
    engine = Engine()
    engine.place(flux_pipe, CFG)
    streamer = _streamers(engine, flux_pipe, ("text_encoder",))["text_encoder"]
    for key in ("base", "full", "half", "base"):
        activate(flux_pipe, sets[key])
        try:
            out = run_flux(flux_pipe)
        finally:
            engine.after_run(flux_pipe)
        _same(out, references[key])
        assert all(torch.equal(slot.host, slot.tensor.detach()) for b in streamer.blocks for slot in b.slots)
    engine.release(flux_pipe)
    assert leftovers(flux_pipe.text_encoder) == []


# -- the denoiser's planner ---------------------------------------------------------------------
class Card(MemoryReader):
    """A card on which every forward peaks ``activations`` above the denoiser's weights, so the
    planner measures on the CPU; the text encoder's activity is made to look huge."""

    def __init__(self) -> None:
        self.activations, self.denoiser = 64 * 2**10, None

    def device_free(self, device):
        return (8 * 2**20, 0)

    def allocator_retries(self, device):
        return 0

    def peak_allocated(self, device):
        return self.denoiser.weights_at_peak() + self.activations


def _planner_state(transformer: torch.nn.Module) -> tuple:
    planner = PLANNER.get(transformer)
    store = planner._store
    return (dict(store._peaks), dict(store._penalties), set(planner.resident), planner.last_workload,
            {w: vars(p).copy() for w, p in planner._penalties.items()}, planner._cycle)


def test_the_encoder_never_touches_the_denoisers_planner(wan_pipe) -> None:
    card = Card()
    engine = Engine(memory=card)
    engine.place(wan_pipe, CFG.replace(preload="auto"))
    card.denoiser = engine.states(wan_pipe)["transformer"].transport
    encoder = _streamers(engine, wan_pipe, ("text_encoder",))["text_encoder"]
    assert PLANNER.get(wan_pipe.text_encoder) is None and encoder.events.names() == ()
    try:
        first = run_wan(wan_pipe)
    finally:
        engine.after_run(wan_pipe)
    planner = PLANNER.get(wan_pipe.transformer)
    assert planner._store.get(planner._key(planner.last_workload)) is not None  # run 1 was measured
    before = copy.deepcopy(_planner_state(wan_pipe.transformer))
    card.activations = 2**40  # whatever the encoder does would be read as a giant peak
    wan_pipe.encode_prompt("a tiny red cat", "blurry", max_sequence_length=16)
    engine.after_run(wan_pipe)
    assert _planner_state(wan_pipe.transformer) == before
    card.activations = 64 * 2**10
    try:
        _same(run_wan(wan_pipe), first)
    finally:
        engine.after_run(wan_pipe)
    engine.release(wan_pipe)


# -- interrupts and the order learnt --------------------------------------------------------------
@pytest.mark.parametrize(("pipe_name", "stop_at"), [("wan_pipe", 2), ("h3_pipe", 40)])
def test_an_interrupt_in_the_text_encode_stops_within_one_layer_and_the_next_run_is_right(
        pipe_name, stop_at, request, monkeypatch) -> None:
    """The host's flag is raised when layer ``stop_at`` is published: no layer is bound after it;
    the partial forward (40 of H3's 53 layers: over half, so it is learnt from) drops no layer from
    the order; after the host's after_run nothing stays loaded and the next run equals the first."""
    pipe, run = request.getfixturevalue(pipe_name), RUN[pipe_name]
    engine = Engine()
    engine.place(pipe, CFG)
    streamer = _streamers(engine, pipe, ("text_encoder",))["text_encoder"]
    layers = len(streamer.units)
    try:
        reference = run(pipe)
    finally:
        engine.after_run(pipe)
    assert streamer.order.units == list(range(layers))
    entered = _count_entries(monkeypatch)
    flag = []

    def on_stage(stage: str, i: int, n: int) -> None:
        if (stage, i) == (TEXT, stop_at):
            flag.append(len(entered))

    def check() -> None:
        if flag:
            raise Interrupted

    with pytest.raises(Interrupted):
        try:
            with StageHooks(pipe, StageHost(on_stage, check)):
                run(pipe)
        finally:
            engine.after_run(pipe)
    assert flag == [stop_at - 1] and [u for _, u in entered] == list(range(stop_at - 1))  # none bound after it
    assert not streamer.head_loaded and not streamer.prefetch.bound and not streamer.ring.nbytes
    entered.clear()
    try:
        _same(run(pipe), reference)
    finally:
        engine.after_run(pipe)
    assert streamer.order.units == list(range(layers))  # the partial forward's order kept every layer
    assert sorted(u for _, u in entered) == [u for u in range(layers) for _ in range(entered.count((id(streamer), 0)))]
    engine.release(pipe)
    assert leftovers(pipe.text_encoder) == [] and pinned_bytes() == 0


def test_h3_calls_the_inner_model_and_each_call_is_one_cycle(h3_pipe) -> None:
    """MiniMax-H3 reads an intermediate hidden state (``text_encoder_layer``) off
    ``text_encoder.model``, bypassing the wrapper the streamer's entry hook sits on: each call must
    still be one cycle of the streamer (told apart by the layers), in layer order; a forward that
    stops early, followed by a full one in the same run, leaves the full order and the right output."""
    engine = Engine()
    engine.place(h3_pipe, CFG)
    streamer = _streamers(engine, h3_pipe, ("text_encoder",))["text_encoder"]
    cycles, calls = [], []
    streamer.events.subscribe("test", lambda event, source, **info: cycles.append(event == "cycle") and False)
    h3_pipe.text_encoder.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    for _ in range(2):
        try:
            run_h3(h3_pipe)
        finally:
            engine.after_run(h3_pipe)
    assert calls and cycles.count(True) == len(calls)
    assert streamer.order.units == list(range(len(streamer.units)))
    reference = run_h3(h3_pipe)
    engine.after_run(h3_pipe)

    def stop(module, args):
        raise Interrupted

    handle = layer_stack(h3_pipe.text_encoder)[40].register_forward_pre_hook(stop)
    with pytest.raises(Interrupted):  # stops after 40 of 53 layers; no after_run before the next call
        run_h3(h3_pipe)
    handle.remove()
    try:
        _same(run_h3(h3_pipe), reference)  # its first call learns from the partial forward
    finally:
        engine.after_run(h3_pipe)
    assert streamer.order.units == list(range(len(streamer.units)))
    engine.release(h3_pipe)


def test_a_partial_forward_learns_what_it_ran_and_keeps_the_rest(wan_pipe) -> None:
    """Unit level, on the Wan transformer streamed in parts: a forward that ran units out of
    registration order and stopped after over half of them is learnt as far as it ran, the units it
    did not reach keep the order known before (none drops out); under half learns nothing; a block
    entered with nothing seen before it and part orders still guessed does not raise (it was an
    IndexError in ``learn_parts``)."""
    engine = Engine()
    engine.place(wan_pipe, CFG.replace(preload="off", stream_parts=True))
    streamer = engine.states(wan_pipe)["transformer"].transport
    n = len(streamer.units)
    assert n >= 6
    streamer.order.set(list(range(n)))
    ran = [*range(n // 2 + 1, 0, -1), n // 2]  # reversed, one unit twice: over half of the units
    learner = streamer.learner
    learner.seen = ran
    learner.learn()
    learnt = [*dict.fromkeys(ran), *(u for u in range(n) if u not in ran)]
    assert streamer.order.units == learnt and sorted(learnt) == list(range(n))
    learner.seen = [n - 1, n - 2]  # under half: a forward cut short, nothing learnt
    learner.learn()
    assert streamer.order.units == learnt
    learner.seen = []
    learner.guessed = {streamer.blocks[0].tower}
    assert not learner.learn_parts(streamer.units)
    assert learner.guessed == {streamer.blocks[0].tower} and streamer.order.units == learnt
    engine.release(wan_pipe)


def test_an_oom_in_an_encoder_layer_takes_the_denoisers_kept_blocks_and_the_encode_goes_on(
        wan_pipe, monkeypatch) -> None:
    """The encoder has no planner: a layer buffer that finds no room asks the pipeline for it (the
    denoiser's kept blocks go first, as for a VAE moving in) and the encode runs on, bit-exact."""
    reference = run_wan(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, CFG)
    denoiser = engine.states(wan_pipe)["transformer"].transport
    engine.place(wan_pipe, CFG.replace(preload=1.5 * max(b.nbytes for b in denoiser.blocks) / 2**30))
    kept = denoiser.resident_indices()
    assert kept
    encoder = _streamers(engine, wan_pipe, ("text_encoder",))["text_encoder"]
    failures, real = [], encoder.ring.acquire

    def acquire(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise torch.OutOfMemoryError("scripted: no room for the layer buffer")
        return real(*args, **kwargs)

    monkeypatch.setattr(encoder.ring, "acquire", acquire)
    during = []
    layer_stack(wan_pipe.text_encoder)[0].register_forward_hook(
        lambda *_: during.append(denoiser.resident_indices()))
    try:
        out = run_wan(wan_pipe)
    finally:
        engine.after_run(wan_pipe)
    assert failures and encoder.ooms == 1 and during[0] < kept
    _same(out, reference)
    engine.release(wan_pipe)

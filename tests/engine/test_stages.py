"""Stage hooks on a placed tiny MiniMax-H3 (real diffusers modular code, no ComfyUI).

What must hold: every stage publishes each of its units in order with the right totals; an
interrupt raised by the host stops the stage before the next unit runs (no layer, step or chunk
runs after the flag) and the next run on the same placed pipeline gives the reference output; a
text encode stopped half-way leaves nothing in the prompt-embedding cache (the next run with that
prompt encodes it whole); the hooks live for one call only and never touch an offload hook, so
re-placing with unchanged settings changes nothing. The prompt cache stays on (its default): each
test that needs the text encoder to run gives a prompt of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.models.minimax_h3 import grid as grid_rules
from diffusers_offload.offload_core.run.prompt_cache import PromptCache
from diffusers_offload.offload_core.run.stages import (
    AUDIO,
    DENOISE,
    TEXT,
    VIDEO,
    StageHooks,
    StageHost,
    label,
    layer_stack,
)
from diffusers_offload.offload_core.state import PROMPT_CACHE
from fixtures.hook_inventory import hook_inventory
from fixtures.tiny_models import H3_TEXT_LAYERS
from fixtures.tiny_pipes import load_h3, run_h3

# Every role gets a real transport on the tiny model (leaf text encoder, per-step denoiser, on-demand VAEs).
CFG = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
STEPS = 3  # H3's scheduler takes grid points: 3 steps = 2 denoiser forwards
TOTALS = {DENOISE: STEPS - 1, VIDEO: 7}  # 124 frames = 37 latent frames = 7 chunks of one 32x32 tile


class Interrupted(BaseException):
    """Stands in for ComfyUI's InterruptProcessingException (a BaseException in 2026 trees)."""


class Host:
    """Records what the hooks publish; raises at the check after ``stop_at`` was published."""

    def __init__(self, stop_at: tuple[str, int] | None = None) -> None:
        self.events: list[tuple[str, int, int]] = []
        self.stop_at = stop_at
        self.flag = False
        self.checks = 0

    def on_stage(self, stage: str, i: int, n: int) -> None:
        self.events.append((stage, i, n))
        if (stage, i) == self.stop_at:
            self.flag = True

    def check(self) -> None:
        self.checks += 1
        if self.flag:
            self.flag = False
            raise Interrupted

    def stage_host(self) -> StageHost:
        return StageHost(self.on_stage, self.check)


@pytest.fixture(scope="module")
def placed(tiny_h3_dir: Path) -> Iterator[tuple[Engine, object]]:
    engine = Engine()
    pipe = load_h3(tiny_h3_dir, "t2va")
    engine.place(pipe, CFG)
    yield engine, pipe
    engine.release(pipe)


def staged_run(engine: Engine, pipe: object, host: Host, prompt: str) -> object:
    """What a host does around a call: hooks for the call, the engine's end of run in a finally."""
    try:
        with StageHooks(pipe, host.stage_host(), TOTALS):
            return run_h3(pipe, num_inference_steps=STEPS, prompt=prompt)
    finally:
        engine.after_run(pipe)


def prompt_cache(pipe: object) -> PromptCache:
    cache = PROMPT_CACHE.get(pipe)
    assert cache is not None and cache.max_bytes > 0  # placed with the cache on
    return cache


def encoded(host: Host) -> int:
    """Text-encoder layers a run published (0: its prompt came from the cache)."""
    return sum(stage == TEXT for stage, _, _ in host.events)


def offload_hooks(pipe: object) -> dict[tuple[str, str, str], object]:
    """Every diffusers registry hook and instance-level forward/entry under the components."""
    return hook_inventory(pipe, ("text_encoder", "transformer", "vae", "audio_vae"))


def torch_hooks(pipe: object) -> int:
    """Torch forward hooks under the components (weight norm keeps some of its own: compare counts)."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
               for comp in ("text_encoder", "transformer", "vae", "audio_vae") for m in getattr(pipe, comp).modules())


def test_every_stage_publishes_each_unit_in_order(placed: tuple[Engine, object]) -> None:
    engine, pipe = placed
    host = Host()

    staged_run(engine, pipe, host, "a robot, every stage")

    layers = len(layer_stack(pipe.text_encoder))
    assert layers == H3_TEXT_LAYERS
    assert host.events == [
        *((TEXT, i, layers) for i in range(1, layers + 1)),
        (DENOISE, 1, 2), (DENOISE, 2, 2),
        *((VIDEO, j, 7) for j in range(1, 8)),
        (AUDIO, 1, 1),
    ]
    assert host.checks == len(host.events)
    assert grid_rules.decode_units(pipe.vae, 37, 32, 32) == 7  # the total the hooks were given is the VAE's own
    assert label(DENOISE, 2, 2) == "denoise step 2/2" and label(AUDIO, 1, 1) == "audio decode 1/1"
    assert label(VIDEO, 3, 0) == "video decode chunk 3"


@pytest.mark.parametrize(("stage", "unit"), [(TEXT, 10), (DENOISE, 2), (VIDEO, 3)])
def test_interrupt_stops_before_the_next_unit_and_the_next_run_matches(
    placed: tuple[Engine, object], stage: str, unit: int
) -> None:
    engine, pipe = placed
    prompt = f"a robot, stopped in {stage} {unit}"
    reference = staged_run(engine, pipe, Host(), prompt)
    if stage == TEXT:  # the reference's embeddings dropped: the stopped run and the next one encode the prompt
        prompt_cache(pipe).clear()
    own_hooks = torch_hooks(pipe)
    units = {TEXT: list(layer_stack(pipe.text_encoder)), DENOISE: [pipe.transformer], VIDEO: [pipe.vae.decoder]}
    done: list[str] = []
    handles = [m.register_forward_hook(lambda *_, s=s: done.append(s)) for s, ms in units.items() for m in ms]
    host = Host(stop_at=(stage, unit))
    try:
        with pytest.raises(Interrupted):
            staged_run(engine, pipe, host, prompt)
    finally:
        for handle in handles:
            handle.remove()

    assert host.events[-1] == (stage, unit, host.events[-1][2])  # nothing published after the flag
    assert done.count(stage) == unit - 1  # units before the flagged one ran, the flagged one did not
    assert torch_hooks(pipe) == own_hooks
    assert not any(t.loaded for t in engine.states(pipe)["vae"].transport.group.members)
    host = Host()
    again = staged_run(engine, pipe, host, prompt)
    assert encoded(host) == (H3_TEXT_LAYERS if stage == TEXT else 0)  # a stopped encode is run again whole; a finished one cached
    torch.testing.assert_close(again, reference, rtol=0, atol=0)


def test_a_text_encode_stopped_half_way_caches_nothing(placed: tuple[Engine, object]) -> None:
    """The cache keeps finished encodes only: after a stop in the text encoder the same prompt is
    encoded again, and from then on served from the cache with the same output."""
    engine, pipe = placed
    prompt, cache = "a robot, stopped while encoding", prompt_cache(pipe)
    entries, misses = len(cache.entries), cache.misses

    with pytest.raises(Interrupted):
        staged_run(engine, pipe, Host(stop_at=(TEXT, 5)), prompt)

    assert (len(cache.entries), cache.misses) == (entries, misses)  # nothing kept, not even counted
    first, second = Host(), Host()
    encoded_once = staged_run(engine, pipe, first, prompt)
    assert encoded(first) == H3_TEXT_LAYERS and len(cache.entries) == entries + 1
    hits = cache.hits
    from_cache = staged_run(engine, pipe, second, prompt)
    assert encoded(second) == 0 and cache.hits == hits + 1
    torch.testing.assert_close(from_cache, encoded_once, rtol=0, atol=0)


def test_hooks_live_for_one_call_and_replacing_changes_no_offload_hook(placed: tuple[Engine, object]) -> None:
    engine, pipe = placed
    before, states, own_hooks = offload_hooks(pipe), engine.states(pipe), torch_hooks(pipe)
    assert before

    with StageHooks(pipe, Host().stage_host(), TOTALS) as hooks:
        assert torch_hooks(pipe) - own_hooks == H3_TEXT_LAYERS + 1 + 2 + 1  # layers, denoiser, VAE encoder + decoder, audio decoder
        with pytest.raises(RuntimeError, match="already installed"):
            hooks.install()
        engine.place(pipe, CFG.replace())  # same settings, placed while the stage hooks are on
    engine.place(pipe, CFG.replace())

    after = offload_hooks(pipe)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert all(engine.states(pipe)[n] is states[n] for n in states)
    assert torch_hooks(pipe) == own_hooks

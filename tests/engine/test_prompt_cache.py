"""The prompt-embedding cache: a text encoder does not run again for what it already encoded
(issue 24.3), on real tiny pipelines (Wan, Flux, LTX-2 classic; MiniMax-H3 modular)."""

from __future__ import annotations

import logging

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.config import OffloadConfigError
from diffusers_offload.offload_core.lora import LoraSpec, activate
from diffusers_offload.offload_core.run.prompt_cache import PromptCache, fingerprint
from diffusers_offload.offload_core.state import PROMPT_CACHE, leftovers
from fixtures.tiny_pipes import run_flux, run_h3, run_h3_fl2va, run_ltx2, run_wan
from PIL import Image
from safetensors.torch import save_file

AUTO = OffloadConfig(mode="auto", on_demand_threshold_gb=0, resident_floor_mb=0)


class Calls(list):
    """Forward runs of one module, counted by a pre-hook the test removes (``handle``)."""

    handle: torch.utils.hooks.RemovableHandle


def count_forwards(module: torch.nn.Module) -> Calls:
    calls = Calls()
    calls.handle = module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_a_seed_change_runs_no_text_encoder_and_outputs_stay_bit_exact(wan_pipe, mode):
    reference = {seed: run_wan(wan_pipe, seed=seed) for seed in (1, 2)}
    engine = Engine()
    engine.place(wan_pipe, AUTO.replace(mode=mode))
    calls = count_forwards(wan_pipe.text_encoder)
    first = run_wan(wan_pipe, seed=1)
    ran_first = len(calls)
    second = run_wan(wan_pipe, seed=2)
    calls.handle.remove()
    assert ran_first > 0 and len(calls) == ran_first, "the second run re-ran the text encoder"
    assert torch.equal(first, reference[1]) and torch.equal(second, reference[2])
    cache = PROMPT_CACHE.get(wan_pipe)
    assert (cache.hits, cache.misses, len(cache.entries)) == (1, 1, 1)
    line = engine.report(wan_pipe).text()
    assert "prompt cache: 1 entries" in line and "1 hits, 1 misses" in line
    engine.release(wan_pipe)


def test_every_input_that_changes_the_embedding_is_a_miss(wan_pipe):
    engine = Engine()
    engine.place(wan_pipe, AUTO)
    calls = count_forwards(wan_pipe.text_encoder)
    run_wan(wan_pipe)
    for change in ({"prompt": "another cat"}, {"negative_prompt": "sharp"}, {"max_sequence_length": 12},
                   {"guidance_scale": 1.0}, {"num_videos_per_prompt": 2}):
        before = len(calls)
        run_wan(wan_pipe, **change)
        assert len(calls) > before, f"{change} did not run the text encoder"
        before = len(calls)
        run_wan(wan_pipe, seed=7, **change)
        assert len(calls) == before, f"{change} repeated with another seed ran the text encoder again"
    calls.handle.remove()
    engine.release(wan_pipe)


def test_a_lora_on_the_text_encoder_drops_the_entries_and_the_base_comes_back(wan_pipe, tmp_path):
    base = run_wan(wan_pipe)
    layer = "text_encoder.encoder.block.0.layer.0.SelfAttention.q"
    q = wan_pipe.text_encoder.get_submodule(layer.split(".", 1)[1])
    path = tmp_path / "te_lora.safetensors"
    save_file({f"{layer}.lora_A.weight": torch.ones(2, q.in_features),
               f"{layer}.lora_B.weight": torch.full((q.out_features, 2), 0.5)}, str(path))
    engine = Engine()
    engine.place(wan_pipe, AUTO)
    calls = count_forwards(wan_pipe.text_encoder)
    assert torch.equal(run_wan(wan_pipe), base)
    activate(wan_pipe, [LoraSpec(str(path), 1.0)])
    before = len(calls)
    with_lora = run_wan(wan_pipe)
    assert len(calls) > before, "the LoRA'd encoder was served the base embeddings"
    assert not torch.equal(with_lora, base)
    activate(wan_pipe, [])
    assert torch.equal(run_wan(wan_pipe), base)
    calls.handle.remove()
    engine.release(wan_pipe)


def test_release_drops_the_cache_and_unwraps_the_entry(wan_pipe):
    run_wan(wan_pipe)  # the pipeline's own run-time attributes exist from here on
    before = set(vars(wan_pipe))
    engine = Engine()
    engine.place(wan_pipe, AUTO)
    assert "encode_prompt" in vars(wan_pipe)
    run_wan(wan_pipe)
    engine.release(wan_pipe)
    assert set(vars(wan_pipe)) - before == set()
    assert PROMPT_CACHE.get(wan_pipe) is None
    assert leftovers(wan_pipe.text_encoder) == []
    calls = count_forwards(wan_pipe.text_encoder)
    run_wan(wan_pipe)
    calls.handle.remove()
    assert calls, "released pipeline still served from a cache"


def test_the_bytes_bound_evicts_least_recently_used_and_zero_turns_it_off(wan_pipe):
    engine = Engine()
    engine.place(wan_pipe, AUTO)
    run_wan(wan_pipe)
    cache = PROMPT_CACHE.get(wan_pipe)
    one = cache.nbytes
    assert one > 0
    engine.place(wan_pipe, AUTO.replace(prompt_cache_gb=1.5 * one / 2**30))  # room for one entry
    assert PROMPT_CACHE.get(wan_pipe) is cache and len(cache.entries) == 1  # a retune keeps entries
    run_wan(wan_pipe, prompt="another cat")
    assert len(cache.entries) == 1 and cache.nbytes <= cache.max_bytes
    calls = count_forwards(wan_pipe.text_encoder)
    run_wan(wan_pipe)  # the first prompt was evicted
    per_run = len(calls)
    assert per_run
    engine.place(wan_pipe, AUTO.replace(prompt_cache_gb=0))
    assert cache.entries == OrderedDictEmpty()
    run_wan(wan_pipe)
    run_wan(wan_pipe)
    calls.handle.remove()
    assert len(calls) == 3 * per_run
    engine.release(wan_pipe)


def OrderedDictEmpty():  # noqa: N802 - reads as a value in the assertion above
    from collections import OrderedDict

    return OrderedDict()


def test_a_negative_or_nan_size_is_refused_by_name():
    for bad in (-1.0, float("nan")):
        with pytest.raises(OffloadConfigError, match="prompt_cache_gb"):
            OffloadConfig(prompt_cache_gb=bad)
    assert "prompt_cache_gb" not in dict(OffloadConfig().hooking())


def test_hits_and_misses_are_logged_at_debug(wan_pipe, caplog):
    engine = Engine()
    engine.place(wan_pipe, AUTO)
    with caplog.at_level(logging.DEBUG, logger="diffusers_offload.prompt_cache"):
        run_wan(wan_pipe)
        run_wan(wan_pipe, seed=3)
    said = [r.getMessage() for r in caplog.records if "prompt cache" in r.getMessage()]
    assert any(m.startswith("prompt cache miss: encode_prompt") for m in said)
    assert any(m.startswith("prompt cache hit: encode_prompt") for m in said)
    engine.release(wan_pipe)


@pytest.mark.parametrize(("fixture", "runner", "encoders"), [
    ("flux_pipe", run_flux, ("text_encoder", "text_encoder_2")),
    ("ltx2_pipe", run_ltx2, ("text_encoder",)),
])
def test_flux_and_ltx2_skip_their_encoders_on_a_seed_change(request, fixture, runner, encoders):
    pipe = request.getfixturevalue(fixture)
    reference = runner(pipe, seed=5)
    engine = Engine()
    engine.place(pipe, AUTO)
    runner(pipe, seed=4)
    counters = [count_forwards(getattr(pipe, name)) for name in encoders]
    again = runner(pipe, seed=5)
    for c in counters:
        c.handle.remove()
    assert all(not c for c in counters)
    for got, want in zip(_tensors(again), _tensors(reference), strict=True):
        assert torch.equal(got, want)
    engine.release(pipe)


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


def test_h3_text_step_is_cached_and_keyframes_key_by_content(h3_fl2va_pipe):
    pipe = h3_fl2va_pipe
    reference = run_h3_fl2va(pipe, seed=1)
    engine = Engine()
    engine.place(pipe, AUTO)
    calls = count_forwards(pipe.text_encoder.model)
    first = run_h3_fl2va(pipe, seed=1)
    ran = len(calls)
    second = run_h3_fl2va(pipe, seed=2)
    assert ran > 0 and len(calls) == ran, "the same prompt and keyframes ran the text encoder again"
    assert torch.equal(first.video, reference.video) and torch.equal(first.audio, reference.audio)
    assert not torch.equal(second.video, first.video)  # the seed still changes the run
    other = Image.new("RGB", (32, 32), (10, 200, 10))
    run_h3_fl2va(pipe, seed=1, last_image=other)
    assert len(calls) > ran, "another keyframe was served the old embedding"
    calls.handle.remove()
    engine.release(pipe)
    assert not [b for b in _leaves(pipe._blocks) if vars(b).get("_diffusers_offload_block_class")]
    assert not [b for b in _leaves(pipe._blocks) if getattr(type(b), "_caches_prompts", False)]
    assert PROMPT_CACHE.get(pipe) is None


def test_h3_t2va_prompt_change_misses(h3_pipe):
    engine = Engine()
    engine.place(h3_pipe, AUTO)
    calls = count_forwards(h3_pipe.text_encoder.model)
    run_h3(h3_pipe)
    ran = len(calls)
    run_h3(h3_pipe, seed=9)
    assert len(calls) == ran
    run_h3(h3_pipe, prompt="a different sound")
    assert len(calls) > ran
    calls.handle.remove()
    engine.release(h3_pipe)


def _leaves(blocks) -> list:
    subs = getattr(blocks, "sub_blocks", None) or {}
    return [blocks] if not subs else [leaf for sub in subs.values() for leaf in _leaves(sub)]


def test_fingerprints_follow_content_not_identity():
    a = torch.arange(6, dtype=torch.bfloat16)
    assert fingerprint(a) == fingerprint(a.clone())
    assert fingerprint(a) != fingerprint(a + 1)
    assert fingerprint(Image.new("RGB", (4, 4), (1, 2, 3))) == fingerprint(Image.new("RGB", (4, 4), (1, 2, 3)))
    assert fingerprint(Image.new("RGB", (4, 4), (1, 2, 3))) != fingerprint(Image.new("RGB", (4, 4), (1, 2, 4)))
    assert fingerprint(1) != fingerprint(1.0) != fingerprint(True)
    cache = PromptCache(1 << 20, torch.device("cpu"))
    out, hit = cache.call("x", (object(),), lambda: torch.ones(2))
    assert not hit and not cache.entries  # an argument without a fingerprint runs uncached

"""Which denoiser a LoRA goes into (``LoraSpec.into``): Wan 2.2 A14B's LoRAs come in high/low-noise
pairs, the low-noise one for its second expert (``transformer_2``). On the placed tiny A14B each
choice computes what diffusers' own loading gives (``load_lora_weights``, with
``load_into_transformer_2`` for the second expert), and clearing the set restores the base bits;
a pipeline with one denoiser refuses ``denoiser_2`` by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.lora import INTO, LoraError, LoraSpec, activate, check
from fixtures import tiny_loras
from fixtures.tiny_wan_families import load_wan_family, run_wan_family

wan_loras = tiny_loras.wan_loras  # the session fixture, registered here

STREAMED = OffloadConfig(mode="auto", preload="off", on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


@pytest.fixture(scope="module")
def a14b(tiny_wan_family) -> Path:
    return tiny_wan_family("wan22_a14b")


@pytest.fixture(scope="module")
def lora(a14b: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA on the attention projections of the A14B's (shared) transformer geometry."""
    return tiny_loras.wan_lora(load_wan_family(a14b).transformer, tmp_path_factory.mktemp("a14b-lora"), seed=3)


def _diffusers(a14b: Path, lora: Path, into: str) -> torch.Tensor:
    """The frames with the LoRA loaded by diffusers (peft layers) into the denoiser(s) ``into`` names."""
    pipe = load_wan_family(a14b)
    for name, second in (("high", False), ("low", True)):
        if into == "both" or (into == "denoiser_2") == second:
            pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name=name,
                                   load_into_transformer_2=second)
    return run_wan_family(pipe)


def test_each_choice_computes_what_diffusers_loading_gives_and_clearing_restores(a14b, lora) -> None:
    pipe = load_wan_family(a14b)
    engine = Engine()
    engine.place(pipe, STREAMED)
    try:
        base = run_wan_family(pipe)
        outs = {}
        for into in INTO:  # one set after the other: the previous choice comes off
            activate(pipe, [LoraSpec(str(lora), 1.0, into)])
            outs[into] = run_wan_family(pipe)
            torch.testing.assert_close(outs[into], _diffusers(a14b, lora, into), rtol=1e-5, atol=1e-5)
        activate(pipe, [])
        assert torch.equal(run_wan_family(pipe), base)
    finally:
        engine.release(pipe)
    frames = [base, *outs.values()]
    assert all(not torch.allclose(x, y, atol=1e-4) for i, x in enumerate(frames) for y in frames[i + 1:])


def test_denoiser_2_on_a_one_denoiser_pipeline_is_refused_by_name(wan_pipe, wan_loras) -> None:
    with pytest.raises(LoraError, match=r"WanPipeline has one denoiser \(transformer\), not two: set into to 'denoiser'"):
        check(wan_pipe, LoraSpec(str(wan_loras["a"]), 1.0, "denoiser_2"))


def test_an_unknown_choice_is_refused() -> None:
    with pytest.raises(ValueError, match=r"into='high' is not one of"):
        LoraSpec("x.safetensors", 1.0, "high")

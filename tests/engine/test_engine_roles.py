"""Roles the engine gives each component of the tiny pipelines."""

import logging

import pytest
import torch
from diffusers.hooks import group_offloading as diffusers_go
from diffusers_offload.offload_core import Components, Engine, OffloadConfig
from diffusers_offload.offload_core.memory import MemoryReader
from fixtures.tiny_pipes import run_h3

CFG = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


def _roles(pipe) -> dict[str, str]:
    report = Engine().place(pipe, CFG)
    return {c.name: c.role for c in report.components}


def test_wan_roles_transformer_per_step_text_encoder_leaf_vae_on_demand(wan_pipe):
    assert _roles(wan_pipe) == {"transformer": "per-step", "text_encoder": "leaf", "vae": "on-demand"}


def test_flux_roles_transformer_per_step_both_text_encoders_leaf_vae_on_demand(flux_pipe):
    assert _roles(flux_pipe) == {
        "transformer": "per-step", "text_encoder": "leaf", "text_encoder_2": "leaf", "vae": "on-demand",
    }


def test_flux_streams_both_towers_dual_and_single_stream_blocks(flux_pipe):
    details = Engine().place(flux_pipe, CFG).component("transformer").details
    towers = len(flux_pipe.transformer.transformer_blocks) + len(flux_pipe.transformer.single_transformer_blocks)
    assert details["blocks"] == towers and details["kept"] == 0


def test_ltx2_roles_vaes_on_demand_transformer_per_step_rest_leaf(ltx2_pipe):
    assert _roles(ltx2_pipe) == {
        "vae": "on-demand", "audio_vae": "on-demand", "transformer": "per-step",
        "text_encoder": "leaf", "connectors": "leaf", "vocoder": "leaf",
    }


def test_h3_audio_vae_on_demand_because_its_class_opts_out(h3_pipe):
    report = Engine().place(h3_pipe, CFG)
    audio = report.component("audio_vae")
    assert audio.role == "on-demand"
    assert "opts out" in audio.reason
    assert report.component("transformer").role == "per-step"
    assert report.component("text_encoder").role == "leaf"
    assert report.component("vae").role == "on-demand"


class _NoRoomToPin(MemoryReader):
    """A host with no free memory: the pin budget denies every component, so a text encoder takes
    the leaf path (with a grant its layers stream: test_text_encoder_streaming.py)."""

    def host_available(self) -> int:
        return 0


def test_h3_text_encoder_leaf_hooks_fire_when_pipeline_calls_inner_model(h3_pipe, monkeypatch):
    engine = Engine(memory=_NoRoomToPin())
    engine.place(h3_pipe, CFG)
    assert engine.states(h3_pipe)["text_encoder"].transport.name == "leaf"
    te_modules = {id(m) for m in h3_pipe.text_encoder.modules()}
    onloads = []
    original = diffusers_go.ModuleGroup.onload_

    def counting(group, *a, **kw):
        if any(id(m) in te_modules for m in (*group.modules, group.onload_leader)):
            onloads.append(group)
        return original(group, *a, **kw)

    monkeypatch.setattr(diffusers_go.ModuleGroup, "onload_", counting)
    run_h3(h3_pipe)
    engine.after_run(h3_pipe)
    assert len(onloads) > 0, "no leaf group of the H3 text encoder onloaded during a run"


@pytest.mark.parametrize("workflow_fixture", ["h3_fl2va_pipe"])
def test_h3_fl2va_roles_match_t2va(workflow_fixture, request):
    pipe = request.getfixturevalue(workflow_fixture)
    roles = _roles(pipe)
    assert roles["transformer"] == "per-step"
    assert roles["text_encoder"] == "leaf"
    assert roles["audio_vae"] == "on-demand"


class _UnbridgedDecoder(torch.nn.Module):
    """A decoder entered through ``decode`` without diffusers' forward-hook bridge."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(512, 512)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


@pytest.mark.parametrize("mode", ["auto", "model"])
def test_a_decode_without_the_bridge_stays_resident_with_a_warning_in_auto_and_model(mode, caplog):
    """It could not be moved in on entry: on demand it would decode with its weights in system
    memory (in model mode it did, before)."""
    pipe = Components(vae=_UnbridgedDecoder())
    with caplog.at_level(logging.WARNING, logger="diffusers_offload"):
        report = Engine().place(pipe, CFG.replace(mode=mode))
    assert report.component("vae").role == "resident"
    assert "decode without diffusers' forward-hook bridge" in caplog.text


@pytest.mark.parametrize("threshold_gb", [0, 1])  # on demand; resident (small), its calls given room
def test_a_bridged_decode_under_a_well_behaved_wrapper_keeps_its_bridge(wan_pipe, monkeypatch, threshold_gb):
    """A profiler or another pack that wraps the VAE class's ``decode`` with ``functools.wraps``
    keeps diffusers' bridge under it: the decode still moves an on-demand VAE in, and a resident
    VAE's decode still asks the other components for its working memory (`workspace.py`; without
    it a Qwen-Image decode at 1024² ran out of memory beside the denoiser's kept blocks)."""
    import functools

    from diffusers_offload.offload_core.state import COMPONENT

    vae_cls = type(wan_pipe.vae)
    base, calls = vae_cls.decode, []

    @functools.wraps(base)
    def timed(self, *args, **kwargs):
        calls.append(1)
        return base(self, *args, **kwargs)

    monkeypatch.setattr(vae_cls, "decode", timed)
    engine = Engine()
    try:
        role = engine.place(wan_pipe, CFG.replace(on_demand_threshold_gb=threshold_gb)).component("vae").role
        transport = COMPONENT.get(wan_pipe.vae).transport
        assert (role, transport.entries) == ("resident" if threshold_gb else "on-demand", ("encode", "decode"))
        wan_pipe.vae.decode(torch.randn(1, wan_pipe.vae.config.z_dim, 1, 4, 4))
        assert calls == [1]
    finally:
        engine.release(wan_pipe)


def test_a_clip_image_encoder_is_reported_as_an_image_encoder():
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                                             num_attention_heads=4, image_size=32, patch_size=8))
    pipe, engine = Components(image_encoder=encoder), Engine(memory=_NoRoomToPin())
    assert engine.place(pipe, CFG).component("image_encoder").reason == "image encoder"
    engine.release(pipe)
    granted = Engine().place(pipe, CFG).component("image_encoder").reason  # its layers are the tiny model's lesser part
    assert granted == "image encoder: pin granted, its layers under half of it: leaf groups"


def test_the_report_names_each_denoisers_plan_when_there_are_two(wan_pipe):
    """Wan 2.2 A14B's ``transformer`` and ``transformer_2``: the preload line shows both plans."""
    import copy

    pipe = Components(transformer=wan_pipe.transformer, transformer_2=copy.deepcopy(wan_pipe.transformer))
    engine = Engine()
    report = engine.place(pipe, CFG.replace(preload="off"))
    assert report.plan.startswith("transformer: ") and "; transformer_2: " in report.plan
    assert "preload: transformer: " in report.text()
    engine.release(pipe)

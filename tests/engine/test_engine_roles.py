"""Roles the engine gives each component of the tiny pipelines (SPEC §2)."""

import pytest
from diffusers.hooks import group_offloading as diffusers_go
from diffusers_offload.offload_core import Engine, OffloadConfig
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


def test_h3_text_encoder_leaf_hooks_fire_when_pipeline_calls_inner_model(h3_pipe, monkeypatch):
    engine = Engine()
    engine.place(h3_pipe, CFG)
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

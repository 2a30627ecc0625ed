"""On-demand VAEs stay on the device across their own consecutive calls of one run and go home
when a denoiser starts or the run ends (issue 24.4); outputs bit-exact, release unpins."""

from __future__ import annotations

import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.pinning import pinned_bytes
from diffusers_offload.offload_core.transport import on_demand
from fixtures.tiny_pipes import run_h3_fl2va

AUTO = OffloadConfig(mode="auto", on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu", prompt_cache_gb=0)


def test_fl2va_moves_the_vae_in_once_for_two_keyframes_and_once_for_the_decode(h3_fl2va_pipe, monkeypatch):
    pipe = h3_fl2va_pipe
    reference = run_h3_fl2va(pipe)
    engine = Engine()
    engine.place(pipe, AUTO)
    vae = engine.states(pipe)["vae"].transport
    assert engine.states(pipe)["vae"].decision.role.value == "on-demand"
    moves: list[str] = []
    real = on_demand.move_module
    monkeypatch.setattr(on_demand, "move_module",
                        lambda module, device, **kw: moves.append(type(module).__name__) or real(module, device, **kw))
    entries: list[int] = []
    real_onload = vae.onload
    monkeypatch.setattr(vae, "onload", lambda: entries.append(vae.loaded) or real_onload())
    out = run_h3_fl2va(pipe)
    engine.after_run(pipe)
    assert torch.equal(out.video, reference.video) and torch.equal(out.audio, reference.audio)
    vae_moves = moves.count(type(pipe.vae).__name__)
    assert entries.count(False) == vae_moves == 2, (entries, moves)  # two keyframes: one move; decode: one
    assert entries.count(True) >= 1  # the second keyframe found it loaded
    assert not vae.loaded
    engine.release(pipe)
    assert pinned_bytes() == 0


def test_the_vae_goes_home_after_a_call_that_leaves_too_little_free(h3_fl2va_pipe, monkeypatch, caplog):
    """Staying loaded must leave the pipeline the working memory the VAE asked for on entry (the
    float post-processing after a decode allocates outside any component): with less free than
    that after each call, every encode and the decode move it in again."""
    pipe = h3_fl2va_pipe
    reference = run_h3_fl2va(pipe)
    engine = Engine()
    engine.place(pipe, AUTO)
    vae = engine.states(pipe)["vae"].transport
    room = int(on_demand.module_bytes(pipe.vae) * on_demand.WORKSPACE_FRACTION)
    monkeypatch.setattr(vae.ctx.memory, "device_available", lambda device: room - 1)
    moves: list[str] = []
    real = on_demand.move_module
    monkeypatch.setattr(on_demand, "move_module",
                        lambda module, device, **kw: moves.append(type(module).__name__) or real(module, device, **kw))
    with caplog.at_level("INFO", logger="diffusers_offload.on_demand"):
        out = run_h3_fl2va(pipe)
    engine.after_run(pipe)
    assert torch.equal(out.video, reference.video) and torch.equal(out.audio, reference.audio)
    assert moves.count(type(pipe.vae).__name__) == 3, moves  # each keyframe and the decode
    assert "goes home after its call" in caplog.text
    assert not vae.loaded
    engine.release(pipe)
    assert pinned_bytes() == 0

"""Stage hooks of classic pipelines (``offload_core.run.classic``) on the tiny Flux, Wan and LTX-2
pipelines, no ComfyUI: which units are hooked and how many decode units a call has.

What must hold: every text encoder is hooked on its text layers (Flux's CLIP and T5, LTX-2's Gemma
language model, never its vision tower); the decode total is Wan's latent frame count, one for a
KL or LTX-2 batch, open under tiling; a classic call publishes text and decode units, not the
denoiser's forwards (its step callback counts steps), yet still checks for an interrupt there.
"""

from __future__ import annotations

import torch
from diffusers_offload.offload_core.components import iter_modules
from diffusers_offload.offload_core.run.classic import classic_hooks, decode_stage, decode_units
from diffusers_offload.offload_core.run.stages import (
    STILL,
    TEXT,
    VIDEO,
    StageHost,
    layer_stack,
    text_encoders,
)
from fixtures.tiny_pipes import run_flux


def test_every_text_encoder_is_hooked_on_its_text_layers(flux_pipe, ltx2_pipe) -> None:
    flux = text_encoders(dict(iter_modules(flux_pipe)))
    assert list(flux) == ["text_encoder", "text_encoder_2"]
    assert layer_stack(flux["text_encoder"]) is flux_pipe.text_encoder.encoder.layers
    assert layer_stack(flux["text_encoder_2"]) is flux_pipe.text_encoder_2.encoder.block  # not a block's sublayers

    gemma = ltx2_pipe.text_encoder
    gemma.model.vision_tower.encoder.layers.extend(torch.nn.Identity() for _ in range(4))  # longer
    assert layer_stack(gemma) is gemma.model.language_model.layers


def test_decode_units_follow_the_vae(flux_pipe, wan_pipe) -> None:
    assert decode_units(wan_pipe, {"num_frames": 9}) == 3  # one decoder call per latent frame
    assert decode_units(wan_pipe, {"num_frames": 81}) == 21
    assert decode_units(flux_pipe, {"num_images_per_prompt": 2}) == 1  # one call for the batch
    flux_pipe.vae.use_slicing = True
    assert decode_units(flux_pipe, {"num_images_per_prompt": 2}) == 2
    wan_pipe.vae.use_tiling = True
    assert decode_units(wan_pipe, {"num_frames": 9}) == 0  # depends on the tiles: left open
    assert (decode_stage({"num_frames": 9}), decode_stage({"height": 32})) == (VIDEO, STILL)


def test_a_classic_call_publishes_text_and_decode_units_and_checks_the_denoiser(flux_pipe) -> None:
    events: list[tuple[str, int, int]] = []
    checks: list[int] = []
    host = StageHost(lambda stage, i, n: events.append((stage, i, n)), lambda: checks.append(1))

    with classic_hooks(flux_pipe, host, {"height": 32, "width": 32}):
        run_flux(flux_pipe, num_inference_steps=2)

    assert events == [(TEXT, 1, 2), (TEXT, 2, 2), (TEXT, 1, 2), (TEXT, 2, 2), (STILL, 1, 1)]  # CLIP, T5, decode
    assert len(checks) == len(events) + 2  # and one check per denoiser forward
    assert not any(m._forward_pre_hooks for _, c in iter_modules(flux_pipe) for m in c.modules())  # removed

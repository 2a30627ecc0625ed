"""Stage hooks of a classic ``DiffusionPipeline`` call, from the call's own keyword arguments.

Why: a classic pipeline runs its stages inside one ``__call__``; its step callback covers the
denoise loop only. The same `StageHooks` as a modular call cover the rest (every text encoder per
layer, the VAE decoder per chunk or tile), with the denoise stage left to the step callback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .stages import DENOISE, STILL, VIDEO, StageHooks, StageHost

# VAE switches under which the decoder's call count depends on tile sizes: the total is left open.
TILED = ("use_tiling", "use_framewise_decoding")


def decode_stage(call: Mapping[str, Any]) -> str:
    """`VIDEO` for a call that makes frames, `STILL` for an image."""
    return VIDEO if "num_frames" in call else STILL


def decode_units(pipe: Any, call: Mapping[str, Any]) -> int:
    """How many times the VAE decoder runs in this call, where that is known beforehand; 0 when not.

    diffusers' Wan VAE decodes one latent frame per decoder call (its causal cache carries the
    rest); the KL and LTX-2 VAEs decode a batch in one call; slicing splits the batch.
    """
    vae = getattr(pipe, "vae", None)
    if vae is None or any(getattr(vae, flag, False) for flag in TILED):
        return 0
    batch = int(call.get("num_images_per_prompt") or call.get("num_videos_per_prompt") or 1)
    per_sample = 1
    if any(c.__name__ == "AutoencoderKLWan" for c in type(vae).__mro__):
        frames = call.get("num_frames")
        temporal = int(getattr(pipe, "vae_scale_factor_temporal", 0) or 0)
        if not frames or not temporal:
            return 0
        per_sample = (int(frames) - 1) // temporal + 1
    return per_sample * (batch if getattr(vae, "use_slicing", False) else 1)


def classic_hooks(pipe: Any, host: StageHost, call: Mapping[str, Any]) -> StageHooks:
    """The stage hooks of one classic call (enter them around it): text encode and decode are
    published, the denoiser is only checked for an interrupt (the step callback publishes steps)."""
    stage = decode_stage(call)
    return StageHooks(pipe, host, {stage: decode_units(pipe, call)}, quiet=(DENOISE,), decode=stage)

"""Per-run variants of a loaded MiniMax-H3 modular pipeline: audio off, stills, grid overrides.

Why: a run's choices must not change the loaded model. A *run view* is a second pipeline object
over the very same components (same modules, same offload hooks, same schedulers) whose blocks
and model facts differ for this call only:

- audio off: the audio decode block is removed from the view's blocks, so the audio VAE never runs
  and there is no soundtrack to mux;
- a still (one frame): the duration floor is lifted on the view, never on the loaded pipeline, so
  the next run on it is back to the 5–15 s rule;
- the patch size is read as an int or a tuple, and the VAE's scale factor can be overridden.

`pad_short_latents` covers the still's decode: latents shorter than one VAE chunk would make no
chunk at all, so they are padded (last latent frame repeated) at the decoder and the extra frames
cropped after.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AudioDecodeStep

from ...components import patch_of
from ...log import get_logger

log = get_logger("h3")


def drop_blocks(blocks: Any, kind: type) -> int:
    """Remove every sub-block of class ``kind`` (at any depth) from ``blocks``; returns how many."""
    dropped = 0
    for name, block in list(blocks.sub_blocks.items()):
        if isinstance(block, kind):
            blocks.sub_blocks.pop(name)
            dropped += 1
        elif block.sub_blocks:
            dropped += drop_blocks(block, kind)
    return dropped


def run_view(pipe: Any, *, audio: bool = True, still: bool = False, vae_scale_factor: int = 0) -> Any:
    """A pipeline object for one call over ``pipe``'s components (see the module docstring)."""
    cls = _view_class(type(pipe), still, vae_scale_factor)
    view = cls.__new__(cls)
    view.__dict__.update(pipe.__dict__)
    if not audio:
        blocks = pipe.blocks  # a deep copy: the loaded pipeline keeps its own
        if not drop_blocks(blocks, MiniMaxH3AudioDecodeStep):
            log.warning("%s has no audio decode block to remove", type(pipe).__name__)
        view._blocks = blocks
    return view


@functools.cache
def _view_class(base: type, still: bool, vae_scale_factor: int) -> type:
    overrides: dict[str, Any] = {
        "patch_size": property(lambda self: patch_of(getattr(self, "transformer", None)
                                                     or getattr(self, "transformer_ref", None))),
    }
    if still:
        overrides["min_duration"] = property(lambda self: 0.0)
    if vae_scale_factor:
        overrides["vae_spatial_compression_ratio"] = property(lambda self: vae_scale_factor)
    return type(f"{base.__name__}RunView", (base,), overrides)


@contextmanager
def pad_short_latents(vae: torch.nn.Module) -> Iterator[None]:
    """For the duration of the block, decode latents shorter than one chunk by padding them to a
    whole chunk and cropping the decoded frames back to what the real latents cover."""
    own = vae.__dict__.get("_decode")  # an instance-level _decode someone else set, restored after
    decode = vae._decode
    size, overlap, drop = vae.tokens_chunk_size, vae.token_overlap, vae.config.token_drop
    ratio, pre = vae.temporal_compression_ratio, vae.frame_pre_padding

    def padded(z: torch.Tensor) -> torch.Tensor:
        frames = z.shape[2]
        if frames + drop > size:
            return decode(z)
        full = torch.cat([z, z[:, :, -1:].expand(-1, -1, size + overlap - frames, -1, -1)], dim=2)
        return decode(full)[:, :, : frames * ratio - pre]

    vae._decode = padded
    try:
        yield
    finally:
        if own is None:
            del vae._decode
        else:
            vae._decode = own

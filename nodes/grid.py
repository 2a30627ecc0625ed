"""The sizes a classic pipeline takes, and snapping a request onto them.

Why: every pipeline checks its own sizes deep inside its call (Wan: /16, LTX-2: /32, frames
k·n + 1). Snapping here, with a note the node shows, turns that failure into a visible change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..offload_core.components import denoiser, patch_of

# The pipelines' own input checks refuse other sizes (Wan: /16, LTX-2: /32), whatever the VAE says.
PIPELINE_SPATIAL = {"wan": 16, "ltx2": 32}


@dataclass(frozen=True)
class Grid:
    """Sizes a model takes: width and height multiples of ``spatial``, frames ``temporal``·n + 1."""

    spatial: int
    temporal: int = 1


def model_grid(pipe: Any, family: str) -> Grid:
    """The grid of the loaded model: VAE scale factor × denoiser patch, at least the pipeline's own."""
    processor = getattr(pipe, "video_processor", None) or getattr(pipe, "image_processor", None)
    vae_spatial = int(getattr(getattr(processor, "config", None), "vae_scale_factor", 0) or 8)
    vae_temporal = getattr(pipe, "vae_scale_factor_temporal", None) or getattr(
        pipe, "vae_temporal_compression_ratio", 1
    )
    patch_t, _, patch_w = patch_of(denoiser(pipe))
    spatial = math.lcm(vae_spatial * patch_w, PIPELINE_SPATIAL.get(family, 1))
    return Grid(spatial=spatial, temporal=int(vae_temporal) * patch_t)


def snap_size(value: int, multiple: int) -> int:
    """Nearest multiple (halves round up), at least one multiple."""
    return max(multiple, (value + multiple // 2) // multiple * multiple)


def snap_frames(value: int, temporal: int) -> int:
    """Nearest ``temporal``·n + 1 frame count (halves round up), at least one frame."""
    n = (max(value, 1) - 1 + temporal // 2) // temporal
    return n * temporal + 1

"""MiniMax-H3 sizes: canvas and frame-count snapping, and how many units each stage repeats.

Why: the pipeline refuses a canvas off its grid or a clip outside 5–15 s deep inside a block; a
host snaps first and tells the user what changed. Every number is read from the loaded pipeline
(VAE compression, patch size, chunk geometry, frame rate, duration range, canvas configs), so a
checkpoint with other values snaps to its own grid; the patch size may be an int or a tuple.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_MAX_ASPECT_RATIO,
    MINIMAX_H3_MIN_ASPECT_RATIO,
    align_num_frames,
    video_latent_num_frames,
)

from ...components import patch_of

MODEL = "MiniMax-H3"


@dataclass(frozen=True)
class H3Grid:
    """The sizes one loaded H3 pipeline takes."""

    vae_scale: int
    patch: tuple[int, int, int]
    fps: int
    frames_per_chunk: int
    latents_per_chunk: int
    min_seconds: float
    max_seconds: float
    short_edge: int
    max_pixels: int

    @property
    def multiple(self) -> int:
        """Both canvas axes: the VAE's spatial compression times the spatial patch (32 for H3)."""
        return self.vae_scale * self.patch[2]

    @property
    def min_frames(self) -> int:
        return align_num_frames(math.ceil(self.min_seconds * self.fps), self.frames_per_chunk, self.latents_per_chunk)

    @property
    def max_frames(self) -> int:
        top = align_num_frames(math.floor(self.max_seconds * self.fps), self.frames_per_chunk, self.latents_per_chunk)
        return top if top <= self.max_seconds * self.fps else top - self.frames_per_chunk

    def latent_frames(self, frames: int) -> int:
        aligned = align_num_frames(frames, self.frames_per_chunk, self.latents_per_chunk)
        return video_latent_num_frames(aligned, self.frames_per_chunk, self.latents_per_chunk)


def grid_of(pipe: Any, vae_scale_factor: int = 0) -> H3Grid:
    """The grid of a loaded H3 pipeline; ``vae_scale_factor`` > 0 overrides the VAE's own compression."""
    vae = getattr(pipe, "vae", None)
    scale = vae_scale_factor or int(getattr(vae, "spatial_compression_ratio", 0) or pipe.vae_spatial_compression_ratio)
    denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "transformer_ref", None)
    config = pipe.config
    return H3Grid(
        vae_scale=scale,
        patch=patch_of(denoiser),
        fps=int(pipe.fps),
        frames_per_chunk=int(pipe.vae_frames_per_chunk),
        latents_per_chunk=int(pipe.vae_latents_per_chunk),
        min_seconds=float(pipe.min_duration),
        max_seconds=float(pipe.max_duration),
        short_edge=int(config.get("canvas_short_edge", 768)),
        max_pixels=int(config.get("canvas_max_pixels", 768 * 1344)),
    )


def snap_canvas(grid: H3Grid, width: int, height: int) -> tuple[int, int, list[str]]:
    """(width, height, notes): within the area cap, both axes on the grid; an aspect ratio outside
    what the model was trained on is refused (snapping it would distort the picture)."""
    ratio = width / height
    if not MINIMAX_H3_MIN_ASPECT_RATIO <= ratio <= MINIMAX_H3_MAX_ASPECT_RATIO:
        raise ValueError(
            f"canvas {width}×{height} has aspect {ratio:.3g}; {MODEL} takes 1:4 to 4:1: change width or height"
        )
    m = grid.multiple
    notes = []
    w, h = float(width), float(height)
    if width * height > grid.max_pixels:
        scale = math.sqrt(grid.max_pixels / (width * height))
        w, h = max(m, int(w * scale) // m * m), max(m, int(h * scale) // m * m)
        notes.append(f"canvas {width}×{height} → {w:g}×{h:g} (at most {grid.max_pixels} pixels for {MODEL})")
    snapped = [max(m, round(v / m) * m) for v in (w, h)]
    for name, asked, value in (("width", w, snapped[0]), ("height", h, snapped[1])):
        if value != asked:
            notes.append(f"{name} {asked:g} → {value} (multiple of {m} for {MODEL})")
    return snapped[0], snapped[1], notes


def snap_frames(grid: H3Grid, frames: int) -> tuple[int, list[str]]:
    """(frames, notes): ``frames`` rounded up to the VAE's 17n+5 and kept within the duration range.
    One frame is a still and passes as is (the run lifts the duration floor for it)."""
    if frames == 1:
        return 1, []
    aligned = align_num_frames(max(frames, 1), grid.frames_per_chunk, grid.latents_per_chunk)
    snapped = min(max(aligned, grid.min_frames), grid.max_frames)
    if snapped == frames:
        return frames, []
    rule = (f"{grid.frames_per_chunk}n+{grid.latents_per_chunk} at {grid.fps} fps, "
            f"{grid.min_seconds:g}–{grid.max_seconds:g} s for {MODEL}")
    return snapped, [f"frames {frames} → {snapped} ({rule})"]


# -- units per stage (totals for the progress bar) ------------------------------------------------
def tiles(vae: Any, height: int, width: int) -> int:
    """Spatial tiles the video VAE splits a ``height``×``width`` frame into (1 without tiling)."""
    if not getattr(vae, "use_tiling", False):
        return 1
    rows = vae._split_tiles(height, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height)[0]
    cols = vae._split_tiles(width, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width)[0]
    return len(rows) * len(cols)


def decode_units(vae: Any, latent_frames: int, height: int, width: int) -> int:
    """Decoder calls of one video decode: temporal chunks (as the VAE's ``_decode`` lays them out;
    latents shorter than a chunk are padded to one) times spatial tiles."""
    size, drop = vae.tokens_chunk_size, vae.config.token_drop
    tokens = latent_frames + drop
    chunks = (tokens + (-tokens) % size) // size - int(drop > 0)
    return max(chunks, 1) * tiles(vae, height, width)


def encode_units(vae: Any, images: int, height: int, width: int) -> int:
    """Encoder calls for ``images`` keyframes (one frame each: one clip, tiled)."""
    return images * tiles(vae, height, width)


# -- reference images (ref2va) --------------------------------------------------------------------
MAX_IMAGE_REFERENCES = 9  # diffusers' MiniMaxH3Ref2VASetupStep default (max_images)


def reference_short_edge(pipe: Any) -> int:
    """The short edge every reference image is encoded at (2048 for the released checkpoint)."""
    return int(pipe.config.get("reference_image_short_edge", 2048))


def reference_size(grid: H3Grid, short_edge: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) a reference image is encoded at: its own aspect, scaled (up or down) to the
    reference short edge and put on the canvas grid, as diffusers' ref2va setup step does."""
    if not MINIMAX_H3_MIN_ASPECT_RATIO <= width / height <= MINIMAX_H3_MAX_ASPECT_RATIO:
        raise ValueError(f"a reference image of {width}×{height}: {MODEL} takes 1:4 to 4:1")
    scale, m = short_edge / min(width, height), grid.multiple
    return max(m, round(width * scale / m) * m), max(m, round(height * scale / m) * m)


def reference_units(vae: Any, grid: H3Grid, short_edge: int, sizes: list[tuple[int, int]]) -> int:
    """Encoder calls for reference images of ``sizes`` (width, height): one still each, tiled at its own size."""
    return sum(tiles(vae, h, w) for w, h in (reference_size(grid, short_edge, *size) for size in sizes))

"""MiniMax-H3 run rules without ComfyUI: snapping, run views (audio off, stills), short-latent padding,
and the ref2va workflow (its transformer_ref partition) placed by the engine."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AudioDecodeStep
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.models.minimax_h3 import grid as grid_rules
from diffusers_offload.offload_core.models.minimax_h3.run_view import pad_short_latents, run_view
from diffusers_offload.offload_core.state import leftovers
from fixtures.tiny_h3_ref import run_h3_ref2va
from fixtures.tiny_pipes import load_h3, run_h3

GRID = grid_rules.H3Grid(vae_scale=16, patch=(1, 2, 2), fps=24, frames_per_chunk=17, latents_per_chunk=5,
                         min_seconds=5.0, max_seconds=15.0, short_edge=768, max_pixels=768 * 1344)


@pytest.fixture(scope="module")
def h3_pipe(tiny_h3_dir: Path):
    """One t2va load for the module: views and padding leave the loaded pipeline as it was."""
    return load_h3(tiny_h3_dir, "t2va")


def audio_steps(blocks) -> list[str]:
    return [name for name, block in blocks.sub_blocks.items() if isinstance(block, MiniMaxH3AudioDecodeStep)]


def test_grid_is_read_from_the_pipeline_with_int_or_tuple_patches_and_a_scale_override(h3_pipe) -> None:
    grid = grid_rules.grid_of(h3_pipe)
    assert grid == GRID
    assert (grid.min_frames, grid.max_frames, grid.multiple) == (124, 345, 32)
    assert grid_rules.grid_of(h3_pipe, vae_scale_factor=8).multiple == 16
    assert grid_rules.patch_of(SimpleNamespace(config={"patch_size": 2})) == (1, 2, 2)
    assert grid_rules.patch_of(SimpleNamespace(config={"patch_size": 2, "patch_size_t": 2})) == (2, 2, 2)
    assert grid_rules.patch_of(SimpleNamespace(config={"patch_size": [1, 2, 2]})) == (1, 2, 2)


@pytest.mark.parametrize(
    ("asked", "expected", "notes"),
    [
        ((32, 32), (32, 32), []),
        ((1000, 560), (992, 576), ["width 1000 → 992 (multiple of 32 for MiniMax-H3)",
                                   "height 560 → 576 (multiple of 32 for MiniMax-H3)"]),
        ((1920, 1080), (1344, 736), ["canvas 1920×1080 → 1344×736 (at most 1032192 pixels for MiniMax-H3)"]),
    ],
)
def test_canvas_snaps_to_the_grid_and_the_area_cap(asked, expected, notes) -> None:
    width, height, said = grid_rules.snap_canvas(GRID, *asked)
    assert (width, height) == expected and said == notes
    assert width * height <= GRID.max_pixels


def test_an_aspect_outside_1_4_to_4_1_is_refused() -> None:
    with pytest.raises(ValueError, match="1:4 to 4:1: change width or height"):
        grid_rules.snap_canvas(GRID, 1024, 128)


@pytest.mark.parametrize(("asked", "expected"), [(1, 1), (124, 124), (125, 141), (24, 124), (400, 345)])
def test_frames_align_to_17n_plus_5_within_5_to_15_seconds(asked: int, expected: int) -> None:
    frames, notes = grid_rules.snap_frames(GRID, asked)
    assert frames == expected
    assert notes == ([] if asked == expected else
                     [f"frames {asked} → {expected} (17n+5 at 24 fps, 5–15 s for MiniMax-H3)"])


def test_audio_off_view_drops_the_audio_decode_block_and_never_runs_the_audio_vae(h3_pipe, monkeypatch) -> None:
    decodes: list[int] = []
    real = h3_pipe.audio_vae.decode
    monkeypatch.setattr(h3_pipe.audio_vae, "decode", lambda *a, **k: decodes.append(1) or real(*a, **k))

    out = run_h3(run_view(h3_pipe, audio=False))

    assert out.audio is None and out.video.shape == (1, 124, 3, 32, 32)
    assert decodes == []
    assert audio_steps(h3_pipe._blocks) == ["decode.audio"]  # the loaded pipeline keeps its block
    assert run_h3(h3_pipe).audio.shape == (1, 2, 828) and decodes == [1]


def test_a_still_lifts_the_duration_floor_for_its_view_only_and_pads_short_latents(h3_pipe) -> None:
    with pad_short_latents(h3_pipe.vae):
        still = run_h3(run_view(h3_pipe, audio=False, still=True), num_frames=1)
    assert "_decode" not in h3_pipe.vae.__dict__

    assert still.video.shape == (1, 5, 3, 32, 32)  # 1 frame -> 17*0+5 -> 2 latent frames, decoded via one chunk
    assert torch.isfinite(still.video).all()
    with pytest.raises(ValueError, match="between 5.0 and 15.0 seconds"):
        run_h3(h3_pipe, num_frames=1)
    assert grid_rules.decode_units(h3_pipe.vae, 2, 32, 32) == 1


# -- ref2va: the transformer_ref partition ---------------------------------------------------------
CPU = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


def test_ref2va_loads_only_transformer_ref_and_denoises_with_it(h3_ref2va_pipe) -> None:
    pipe = h3_ref2va_pipe
    assert getattr(pipe, "transformer", None) is None and pipe.transformer_ref is not None
    calls: list[int] = []
    handle = pipe.transformer_ref.register_forward_hook(lambda *_: calls.append(1))
    try:
        out = run_h3_ref2va(pipe)
    finally:
        handle.remove()
    assert calls == [1]  # two grid points: one forward
    assert out.video.shape == (1, 124, 3, 32, 32) and out.audio.shape == (1, 2, 828)
    assert torch.isfinite(out.video).all() and torch.isfinite(out.audio).all()
    assert grid_rules.grid_of(pipe) == GRID  # the patch read from transformer_ref


def test_ref2va_streams_transformer_ref_in_auto_mode_bit_exact_with_mode_none_and_release_leaves_nothing(
    h3_ref2va_pipe,
) -> None:
    pipe = h3_ref2va_pipe
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="none", **CPU))
    expected = run_h3_ref2va(pipe)
    engine.after_run(pipe)
    engine.release(pipe)

    report = engine.place(pipe, OffloadConfig(**CPU))
    ref = report.component("transformer_ref")
    assert "transformer" not in {c.name for c in report.components}
    assert ref.role == "per-step" and ref.details["blocks"] > 0
    assert "transformer_ref" in report.text()
    block = pipe.transformer_ref.transformer_blocks[0]
    leaf = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))
    host_ptr, seen = leaf.weight.data_ptr(), []
    handle = leaf.register_forward_hook(lambda m, a, o: seen.append(m.weight.data_ptr()))
    try:
        placed = run_h3_ref2va(pipe)
    finally:
        handle.remove()
    engine.after_run(pipe)
    assert seen and all(p != host_ptr for p in seen), "transformer_ref's blocks must run from a streamed buffer"
    assert torch.equal(placed.video, expected.video) and torch.equal(placed.audio, expected.audio)

    engine.release(pipe)
    modules = ("text_encoder", "transformer_ref", "vae", "audio_vae")
    assert [found for name in modules for found in leftovers(getattr(pipe, name))] == []
    again = run_h3_ref2va(pipe)
    assert torch.equal(again.video, expected.video) and torch.equal(again.audio, expected.audio)

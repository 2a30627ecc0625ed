"""Generate video + audio (MiniMax-H3): run a loaded modular MiniMax-H3 pipeline.

Why its own node: H3 is modular only (no classic pipeline), and a run has choices the loaded
model must not keep (audio off, a single still). The loaded workflow decides the conditioning:
t2va text only, fl2va first/last frames, ref2va references (images ref_1…ref_9, videos
ref_video_1…3 with their soundtrack, audio clips ref_audio_1…3, in that order: ``h3_refs``);
inputs the workflow cannot take are refused by name. Each run goes through a run view
(``offload_core.models.minimax_h3.run_view``) over the same placed components; placement,
stage progress, Cancel and the end of the call are ``running.Run``'s, the outputs ``outputs.py``'s.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from comfy_api.latest import io

from ..offload_core.models.minimax_h3 import grid as grid_rules
from ..offload_core.models.minimax_h3.run_view import pad_short_latents, run_view
from ..offload_core.run.stages import DENOISE, IMAGE, VIDEO
from . import h3_refs
from .outputs import to_audio, to_pil, video_output
from .running import Run
from .types import CATEGORY, NOTES, SEED_MAX, DiffusersPipe, PipeHandle
from .web_api import search_aliases


def _loaded_as(takes: set[str]) -> str:
    return "ref2va" if "references" in takes else "fl2va" if "image" in takes else "t2va"


def _check_workflow(pipe: Any, keyframes: int, refs: h3_refs.References) -> None:
    """A clear error for inputs the loaded workflow cannot take (a pruned pipeline would ignore or fail deep)."""
    takes = {param.name for param in pipe.blocks.inputs}
    workflow = _loaded_as(takes)
    if refs.names and "references" not in takes:
        raise ValueError(
            f"{refs.label()} are connected but the pipeline is loaded for {workflow}: load it with "
            "workflow ref2va, or disconnect them"
        )
    if keyframes and "image" not in takes:
        raise ValueError(
            f"a first or last frame is connected but the pipeline is loaded for {workflow}: load it "
            "with workflow fl2va, or disconnect the frames"
        )
    if workflow == "ref2va" and "image" not in takes and not refs.names:
        raise ValueError(
            "the pipeline is loaded for ref2va, which needs at least one reference image: connect "
            f"ref_1 (up to {h3_refs.IMAGES[-1]}) or a video to ref_video_1, or load it with workflow "
            "t2va"
        )
    if workflow == "fl2va" and not keyframes:
        raise ValueError(
            "the pipeline is loaded for fl2va, which needs a first or last frame: connect one, or "
            "load it with workflow t2va"
        )
    if refs.names and keyframes:
        raise ValueError(
            f"{refs.label()} and a first or last frame are both connected: ref2va takes references, "
            "fl2va keyframes; disconnect one of them"
        )


def _frames_asked(frames: int, duration: float, fps: int, notes: list[str]) -> int:
    if duration <= 0:
        return frames
    asked = max(round(duration * fps), 1)
    notes.append(f"duration {duration:g} s → {asked} frames at {fps} fps")
    return asked


def _inputs() -> list[io.Input]:
    canvas = "Snapped to multiples of 32, area at most 768×1344, aspect 1:4 to 4:1."
    return [
        DiffusersPipe.Input("pipe", tooltip="A pipeline from 'Load modular pipeline'."),
        io.String.Input("prompt", multiline=True, default=""),
        io.Int.Input("seed", default=0, min=0, max=SEED_MAX, control_after_generate=True),
        io.Int.Input(
            "steps",
            default=30,
            min=2,
            max=1000,
            tooltip="Points of H3's sigma grid, the final 0 included: the model runs steps − 1 times.",
        ),
        io.Int.Input("width", default=1344, min=16, max=8192, step=16, tooltip=canvas),
        io.Int.Input("height", default=768, min=16, max=8192, step=16, tooltip=canvas),
        io.Int.Input(
            "frames",
            default=124,
            min=1,
            max=1000,
            tooltip="At 24 fps; snapped up to 17n+5 within 5–15 s (124…345). 1: a still image.",
        ),
        io.Float.Input(
            "duration",
            default=0.0,
            min=0.0,
            max=60.0,
            step=0.1,
            tooltip="Seconds; when above 0 it sets the frame count instead of frames.",
        ),
        io.Boolean.Input(
            "generate_audio",
            default=True,
            tooltip="Off: the audio decode block is removed (no audio decode, no muxing).",
        ),
        io.Int.Input(
            "vae_scale_factor",
            default=0,
            min=0,
            max=64,
            tooltip="Override of the video VAE's spatial compression; 0: the VAE's own.",
        ),
        io.Image.Input("first_frame", optional=True, tooltip="Keyframe the video starts from (fl2va)."),
        io.Image.Input("last_frame", optional=True, tooltip="Keyframe the video ends on (fl2va)."),
        *h3_refs.inputs(),
    ]


class GenerateH3(io.ComfyNode):
    """Text (and first/last frame, or references) to video with audio on a loaded MiniMax-H3 modular pipeline."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadGenerateH3",
            **search_aliases("h3"),
            display_name="Generate video + audio (MiniMax-H3)",
            category=CATEGORY,
            description=(
                "Runs MiniMax-H3 (t2va; fl2va with a first and/or last frame; ref2va with references, read in "
                f"this order: {h3_refs.ORDER}; a video goes with its soundtrack). Canvas and frames are snapped "
                "to the model's grid with a note; frames = 1 renders a single still image."
            ),
            inputs=_inputs(),
            outputs=[
                io.Video.Output("video", display_name="video"),
                io.Image.Output("images", display_name="frames"),
                io.Audio.Output(
                    "audio",
                    display_name="audio",
                    tooltip="Silence of the clip's length when audio is off or for a still.",
                ),
                NOTES,
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(
        cls,
        pipe: PipeHandle,
        prompt: str,
        seed: int,
        steps: int,
        width: int,
        height: int,
        frames: int,
        duration: float,
        generate_audio: bool,
        vae_scale_factor: int,
        first_frame: torch.Tensor | None = None,
        last_frame: torch.Tensor | None = None,
        **refs: Any,
    ) -> io.NodeOutput:
        h3 = pipe.pipe
        if pipe.family != "minimax_h3":
            raise ValueError(
                f"{type(h3).__name__} is not MiniMax-H3: use 'Generate video (diffusers)' for it"
            )
        keyframes = {
            k: to_pil(v) for k, v in (("image", first_frame), ("last_image", last_frame)) if v is not None
        }
        references = h3_refs.collect(refs, int(h3.audio_sampling_rate))
        _check_workflow(h3, len(keyframes), references)
        grid = grid_rules.grid_of(h3, vae_scale_factor)
        width, height, notes = grid_rules.snap_canvas(grid, width, height)
        frames, frame_notes = grid_rules.snap_frames(grid, _frames_asked(frames, duration, grid.fps, notes))
        notes += frame_notes
        h3_refs.check_video_lengths(h3, references, grid.fps, frames)
        still = frames == 1
        if still and generate_audio:
            notes.append("a still has no soundtrack: audio off for this run")
        with_audio = generate_audio and not still
        run = Run(pipe, cls.hidden.unique_id)
        text = run.show(notes)

        totals = {
            DENOISE: steps - 1,  # H3's scheduler takes grid points; the last one is the terminal 0
            VIDEO: grid_rules.decode_units(h3.vae, grid.latent_frames(frames), height, width),
            IMAGE: grid_rules.encode_units(h3.vae, len(keyframes), height, width)
            + h3_refs.encode_units(h3, grid, references, frames),
        }
        view = run_view(h3, audio=with_audio, still=still, vae_scale_factor=vae_scale_factor)
        kwargs = dict(
            prompt=prompt,
            height=height,
            width=width,
            num_frames=frames,
            num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="pt",
            **keyframes,
            **({"references": references.items} if references.items else {}),
        )
        with run, ExitStack() as stack:
            latent_grid = (grid.latent_frames(frames), height // grid.vae_scale, width // grid.vae_scale)
            stack.enter_context(run.stage_hooks(h3, totals, latent_grid))
            stack.enter_context(pad_short_latents(h3.vae))
            state = view(**kwargs)
        audio = to_audio(state.get("audio"), state.get("sampling_rate")) if with_audio else None
        return video_output(state.get("videos"), audio, grid.fps, text, keep=frames if still else None)


NODES: list[type[io.ComfyNode]] = [GenerateH3]

"""Generate image / Generate video: run a loaded classic diffusers pipeline from a ComfyUI graph.

The call is assembled in ``call.py`` (sizes snapped to ``grid.py``'s model grid, with notes), run
by ``running.Run`` (placement, progress, Cancel, the end of the call also on failure) and
converted by ``outputs.py`` to IMAGE, VIDEO (with the model's audio) and AUDIO.
"""

from __future__ import annotations

import torch
from comfy_api.latest import io

from .call import Call, default_fps, pipeline_for, sample_rate
from .grid import model_grid
from .outputs import to_audio, to_image, video_output
from .running import Run
from .types import CATEGORY, NOTES, SEED_MAX, DiffusersPipe, PipeHandle
from .web_api import search_aliases

SIZE_MAX = 8192
MODULAR_HINT = "; modular pipelines (MiniMax-H3) run through their own node"


def _prompt_inputs() -> list[io.Input]:
    return [
        DiffusersPipe.Input("pipe", tooltip="A pipeline from 'Load diffusers pipeline'."),
        io.String.Input("prompt", multiline=True, default=""),
        io.String.Input(
            "negative_prompt", multiline=True, default="", tooltip="Used where the model takes one; else noted."
        ),
        io.Int.Input("seed", default=0, min=0, max=SEED_MAX, control_after_generate=True),
        io.Int.Input("steps", default=20, min=1, max=1000),
        io.Float.Input(
            "guidance", default=0.0, min=0.0, max=100.0, step=0.1,
            tooltip="Guidance scale where the model takes one; 0 keeps the model's default.",
        ),
    ]


def _size_inputs(width: int, height: int) -> list[io.Input]:
    tip = "Snapped to the model's grid (VAE scale factor × patch), with a note."
    return [
        io.Int.Input("width", default=width, min=16, max=SIZE_MAX, step=16, tooltip=tip),
        io.Int.Input("height", default=height, min=16, max=SIZE_MAX, step=16, tooltip=tip),
    ]


class GenerateImage(io.ComfyNode):
    """Text to image (Flux and the like) with a loaded diffusers pipeline, or an edit of reference
    images where the pipeline takes them (FLUX.2, Qwen-Image-Edit, FLUX.1 Kontext)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadGenerateImage",
            **search_aliases("flux"),
            display_name="Generate image (diffusers)",
            category=CATEGORY,
            description="Runs a text-to-image or image-editing diffusers pipeline; size snapped to the model's grid.",
            inputs=[
                *_prompt_inputs(),
                *_size_inputs(1024, 1024),
                io.Int.Input("batch_size", default=1, min=1, max=64),
                io.Image.Input(
                    "reference_images", optional=True,
                    tooltip="Images to edit or draw from (FLUX.2, Qwen-Image-Edit Plus: every image of the batch, "
                            "then those of the inputs below; FLUX.1 Kontext, Qwen-Image-Edit: the first).",
                ),
                *(io.Image.Input(f"reference_images_{n}", optional=True,
                                 tooltip="More reference images, after the inputs above (a batch holds one size: "
                                         "an image of another size comes through its own input).")
                  for n in (2, 3)),
            ],
            outputs=[io.Image.Output("images", display_name="images"), NOTES],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(
        cls, pipe: PipeHandle, prompt: str, negative_prompt: str, seed: int, steps: int, guidance: float,
        width: int, height: int, batch_size: int, reference_images: torch.Tensor | None = None,
        reference_images_2: torch.Tensor | None = None, reference_images_3: torch.Tensor | None = None,
    ) -> io.NodeOutput:
        call = Call(pipe.pipe)
        call.require("prompt", "height", "width", hint=f"Generate image runs text-to-image pipelines{MODULAR_HINT}.")
        if call.takes("num_frames"):
            raise ValueError(f"{call.name} makes video: use 'Generate video (diffusers)'.")
        call.size(model_grid(pipe.pipe, pipe.family), width, height)
        call.references([b for b in (reference_images, reference_images_2, reference_images_3) if b is not None])
        call.text(prompt, negative_prompt, guidance)
        if batch_size > 1:
            call.offer("num_images_per_prompt", batch_size, f"{call.name} makes one image per run: batch ignored")
        call.sampling(seed, steps)
        run = Run(pipe, cls.hidden.unique_id)
        notes = run.show(call.notes)
        with run:
            out = call.pipe(**call.kwargs, callback_on_step_end=run.step_callback(steps, call.kwargs))
        return io.NodeOutput(to_image(out.images), notes)


class GenerateVideo(io.ComfyNode):
    """Text/image to video (Wan, LTX-2) with a loaded diffusers pipeline; audio when the model makes it."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadGenerateVideo",
            **search_aliases("wan"),
            display_name="Generate video (diffusers)",
            category=CATEGORY,
            description="Runs a text/image-to-video diffusers pipeline; size and frames snapped to the model's grid.",
            inputs=[
                *_prompt_inputs(),
                *_size_inputs(832, 480),
                io.Int.Input("frames", default=81, min=1, max=1025, tooltip="Snapped to the model's k·n+1 grid."),
                io.Float.Input(
                    "fps", default=0.0, min=0.0, max=120.0, step=0.01,
                    tooltip="Playback (and, where the model takes it, conditioning) frame rate; 0: the model's own.",
                ),
                io.Image.Input("start_image", optional=True, tooltip="First frame, for image-to-video."),
                io.Float.Input(
                    "guidance_2", default=0.0, min=0.0, max=100.0, step=0.1, optional=True,
                    tooltip="Wan 2.2 A14B: the guidance scale of its low-noise expert (the last steps); 0: as guidance.",
                ),
                io.Int.Input(
                    "high_noise_steps", default=0, min=0, max=1000, optional=True,
                    tooltip="Wan 2.2 A14B: how many of the steps its high-noise expert runs (the rest: the "
                            "low-noise one); 0: the model's own split (boundary_ratio).",
                ),
            ],
            outputs=[
                io.Video.Output("video", display_name="video"),
                io.Image.Output("images", display_name="frames"),
                io.Audio.Output("audio", display_name="audio", tooltip="Silence of the clip's length when the model makes no audio."),
                NOTES,
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(
        cls, pipe: PipeHandle, prompt: str, negative_prompt: str, seed: int, steps: int, guidance: float,
        width: int, height: int, frames: int, fps: float, start_image: torch.Tensor | None = None,
        guidance_2: float = 0.0, high_noise_steps: int = 0,
    ) -> io.NodeOutput:
        call = Call(pipeline_for(pipe.pipe, start_image))
        call.require("prompt", "num_frames", hint=f"Generate video runs text/image-to-video pipelines{MODULAR_HINT}.")
        grid = model_grid(pipe.pipe, pipe.family)
        call.size(grid, width, height)
        call.frames(grid, frames)
        rate = fps or default_fps(call.pipe, pipe.family)
        if call.takes("frame_rate"):
            call.kwargs["frame_rate"] = rate
        call.start_image(start_image)
        call.text(prompt, negative_prompt, guidance)
        call.second_guidance(guidance_2)
        call.sampling(seed, steps)
        run = Run(pipe, cls.hidden.unique_id)
        with call.expert_split(steps, high_noise_steps):
            notes = run.show(call.notes)
            with run:
                out = call.pipe(**call.kwargs, callback_on_step_end=run.step_callback(steps, call.kwargs))
        audio = to_audio(getattr(out, "audio", None), sample_rate(call.pipe))
        return video_output(out.frames, audio, rate, notes)


NODES: list[type[io.ComfyNode]] = [GenerateImage, GenerateVideo]

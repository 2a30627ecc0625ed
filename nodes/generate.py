"""Generate nodes: run a loaded diffusers pipeline and hand back ComfyUI's own types.

Why: every diffusers pipeline takes its own arguments, sizes and outputs. These nodes offer the
negative prompt, guidance and frame rate only where the loaded pipeline's ``__call__`` takes
them, snap sizes and frame counts to the model's grid with a visible note (instead of a failure
deep inside the pipeline), and convert the results to IMAGE ``[B,H,W,C]`` float32, VIDEO (with the
model's audio when it makes some) and AUDIO. The pipe handle places the pipeline before the call
and is told when the call ends, also on error or interrupt.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import diffusers
import torch
from comfy_api.latest import InputImpl, Types, io
from PIL import Image

from .progress import StepProgress, say
from .types import CATEGORY, DiffusersPipe, PipeHandle

log = logging.getLogger("diffusers_offload.nodes")

SEED_MAX = 0xFFFFFFFFFFFFFFFF
SIZE_MAX = 8192
# The pipelines' own input checks refuse other sizes (Wan: /16, LTX-2: /32), whatever the VAE says.
PIPELINE_SPATIAL = {"wan": 16, "ltx2": 32}
# Playback rate of models whose call takes no frame rate; the call's own default wins otherwise.
FAMILY_FPS = {"wan": 16.0}
DEFAULT_FPS = 24.0
MODULAR_HINT = "; modular pipelines (MiniMax-H3) run through their own node"
# Text-to-video pipelines whose components also run image-to-video under a sibling class.
I2V_VARIANTS = {"LTX2Pipeline": "LTX2ImageToVideoPipeline", "LTXPipeline": "LTXImageToVideoPipeline"}


# ------------------------------------------------------------------------------------ model grid


@dataclass(frozen=True)
class Grid:
    """Sizes a model takes: width and height multiples of ``spatial``, frames ``temporal``·n + 1."""

    spatial: int
    temporal: int = 1


def call_params(pipe: Any) -> Mapping[str, inspect.Parameter]:
    """The keyword arguments the pipeline's ``__call__`` takes."""
    return inspect.signature(pipe.__call__).parameters


def denoiser(pipe: Any) -> Any:
    """The module the pipeline denoises with (transformer or UNet), or None."""
    return getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)


def _config(module: Any) -> Mapping[str, Any]:
    return getattr(module, "config", None) or {}


def _patch(module: Any) -> tuple[int, int]:
    """(temporal, spatial) patch of the denoiser; ``patch_size`` may be an int or a (t, h, w) tuple."""
    config = _config(module)
    patch = config.get("patch_size", 1) or 1
    if isinstance(patch, (tuple, list)):
        return int(patch[0]), int(patch[-1])
    return int(config.get("patch_size_t", 1) or 1), int(patch)


def model_grid(pipe: Any, family: str) -> Grid:
    """The grid of the loaded model: VAE scale factor × denoiser patch, at least the pipeline's own."""
    processor = getattr(pipe, "video_processor", None) or getattr(pipe, "image_processor", None)
    vae_spatial = int(getattr(getattr(processor, "config", None), "vae_scale_factor", 0) or 8)
    vae_temporal = getattr(pipe, "vae_scale_factor_temporal", None) or getattr(
        pipe, "vae_temporal_compression_ratio", 1
    )
    patch_t, patch_s = _patch(denoiser(pipe))
    spatial = math.lcm(vae_spatial * patch_s, PIPELINE_SPATIAL.get(family, 1))
    return Grid(spatial=spatial, temporal=int(vae_temporal) * patch_t)


def snap_size(value: int, multiple: int) -> int:
    """Nearest multiple (halves round up), at least one multiple."""
    return max(multiple, (value + multiple // 2) // multiple * multiple)


def snap_frames(value: int, temporal: int) -> int:
    """Nearest ``temporal``·n + 1 frame count (halves round up), at least one frame."""
    n = (max(value, 1) - 1 + temporal // 2) // temporal
    return n * temporal + 1


# ------------------------------------------------------------------------------- call assembly


@dataclass
class Call:
    """A pipeline call being assembled, with the notes that tell the user what was changed."""

    pipe: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return type(self.pipe).__name__

    def takes(self, name: str) -> bool:
        return name in call_params(self.pipe)

    def offer(self, name: str, value: Any, ignored: str) -> None:
        """Pass ``name`` when the pipeline takes it; otherwise note ``ignored``."""
        if self.takes(name):
            self.kwargs[name] = value
        else:
            self.notes.append(ignored)

    def size(self, grid: Grid, width: int, height: int) -> None:
        for name, value in (("width", width), ("height", height)):
            snapped = snap_size(value, grid.spatial)
            if snapped != value:
                self.notes.append(f"{name} {value} → {snapped} (multiple of {grid.spatial} for {self.name})")
            self.kwargs[name] = snapped

    def frames(self, grid: Grid, frames: int) -> None:
        snapped = snap_frames(frames, grid.temporal)
        if snapped != frames:
            self.notes.append(f"frames {frames} → {snapped} ({grid.temporal}n+1 for {self.name})")
        self.kwargs["num_frames"] = snapped

    def start_image(self, image: torch.Tensor | None) -> None:
        if image is None:
            return
        self.kwargs["image"] = to_pil(image)
        if image.shape[0] > 1:
            self.notes.append(f"start_image: the first of {image.shape[0]} images is used")

    def text(self, prompt: str, negative_prompt: str, guidance: float) -> None:
        self.kwargs["prompt"] = prompt
        if negative_prompt.strip():
            self.offer("negative_prompt", negative_prompt, f"{self.name} takes no negative prompt: ignored")
        if guidance > 0:
            self.offer(self.guidance_key(), guidance, f"{self.name} takes no guidance scale: ignored")

    def guidance_key(self) -> str:
        """``true_cfg_scale`` where the pipeline has real CFG beside a ``guidance_scale`` that only a
        guidance-distilled denoiser reads (Flux, Qwen-Image); ``guidance_scale`` everywhere else."""
        distilled = bool(_config(denoiser(self.pipe)).get("guidance_embeds"))
        return "true_cfg_scale" if self.takes("true_cfg_scale") and not distilled else "guidance_scale"

    def sampling(self, seed: int, steps: int, node_id: str | None) -> None:
        """Steps, a CPU generator (same seed, same image on every device) and the step callback."""
        self.kwargs.update(
            num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="pt",
            callback_on_step_end=StepProgress(steps, node_id),
        )

    def require(self, *names: str, hint: str) -> None:
        missing = [n for n in names if not self.takes(n)]
        if missing:
            raise ValueError(f"{self.name} takes no {', '.join(missing)}: {hint}")

    def announce(self, node_id: str | None) -> str:
        text = "\n".join(self.notes)
        if text:
            say(text, node_id)
        return text


def run(handle: PipeHandle, call: Call) -> Any:
    """Place the pipeline, run it, and always tell the handle the run is over."""
    handle.prepare()
    try:
        return call.pipe(**call.kwargs)
    finally:
        handle.finish()


# ----------------------------------------------------------------------------------- conversion


def to_image(pixels: Any) -> torch.Tensor:
    """``[..., C, H, W]`` pixels in 0..1 → ComfyUI IMAGE ``[N, H, W, C]`` float32 on the CPU."""
    if not isinstance(pixels, torch.Tensor):
        raise TypeError(f"the pipeline returned {type(pixels).__name__}, expected a tensor for output_type='pt'")
    pixels = pixels.detach().to("cpu", torch.float32).clamp(0, 1)
    return pixels.reshape(-1, *pixels.shape[-3:]).permute(0, 2, 3, 1).contiguous()


def to_pil(image: torch.Tensor) -> Image.Image:
    """First frame of a ComfyUI IMAGE as a PIL image (what diffusers' processors take)."""
    array = (image[0].clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(array)


def sample_rate(pipe: Any) -> int:
    """Rate of the waveform the pipeline returns (the vocoder's output rate when there is one)."""
    vocoder = getattr(pipe, "vocoder", None)
    rate = getattr(getattr(vocoder, "config", None), "output_sampling_rate", None)
    return int(rate or getattr(pipe, "audio_sampling_rate", 16000))


def to_audio(waveform: Any, pipe: Any) -> dict[str, Any] | None:
    """ComfyUI AUDIO ``{"waveform": [B, C, T], "sample_rate"}``, or None when the model made none."""
    if not isinstance(waveform, torch.Tensor):
        return None
    waveform = waveform.detach().to("cpu", torch.float32)
    if waveform.ndim == 2:
        waveform = waveform.unsqueeze(0)
    return {"waveform": waveform, "sample_rate": sample_rate(pipe)}


# ----------------------------------------------------------------------------------------- inputs


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


NOTES = io.String.Output("notes", display_name="notes", tooltip="What was snapped or ignored, one line each.")


# ------------------------------------------------------------------------------------------ nodes


class GenerateImage(io.ComfyNode):
    """Text to image (Flux and the like) with a loaded diffusers pipeline."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadGenerateImage",
            display_name="Generate image (diffusers)",
            category=CATEGORY,
            description="Runs a text-to-image diffusers pipeline; size snapped to the model's grid.",
            inputs=[
                *_prompt_inputs(),
                *_size_inputs(1024, 1024),
                io.Int.Input("batch_size", default=1, min=1, max=64),
            ],
            outputs=[io.Image.Output("images", display_name="images"), NOTES],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(
        cls, pipe: PipeHandle, prompt: str, negative_prompt: str, seed: int, steps: int, guidance: float,
        width: int, height: int, batch_size: int,
    ) -> io.NodeOutput:
        node_id = cls.hidden.unique_id
        call = Call(pipe.pipe)
        call.require("prompt", "height", "width", hint=f"Generate image runs text-to-image pipelines{MODULAR_HINT}.")
        if call.takes("num_frames"):
            raise ValueError(f"{call.name} makes video: use 'Generate video (diffusers)'.")
        call.size(model_grid(pipe.pipe, pipe.family), width, height)
        call.text(prompt, negative_prompt, guidance)
        if batch_size > 1:
            call.offer("num_images_per_prompt", batch_size, f"{call.name} makes one image per run: batch ignored")
        call.sampling(seed, steps, node_id)
        notes = call.announce(node_id)
        images = to_image(run(pipe, call).images)
        return io.NodeOutput(images, notes)


class GenerateVideo(io.ComfyNode):
    """Text/image to video (Wan, LTX-2) with a loaded diffusers pipeline; audio when the model makes it."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadGenerateVideo",
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
            ],
            outputs=[
                io.Video.Output("video", display_name="video"),
                io.Image.Output("images", display_name="frames"),
                io.Audio.Output("audio", display_name="audio", tooltip="None when the model makes no audio."),
                NOTES,
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(
        cls, pipe: PipeHandle, prompt: str, negative_prompt: str, seed: int, steps: int, guidance: float,
        width: int, height: int, frames: int, fps: float, start_image: torch.Tensor | None = None,
    ) -> io.NodeOutput:
        node_id = cls.hidden.unique_id
        call = Call(_pipeline_for(pipe.pipe, start_image))
        call.require("prompt", "num_frames", hint=f"Generate video runs text/image-to-video pipelines{MODULAR_HINT}.")
        grid = model_grid(pipe.pipe, pipe.family)
        call.size(grid, width, height)
        call.frames(grid, frames)
        rate = fps or _default_fps(call.pipe, pipe.family)
        if call.takes("frame_rate"):
            call.kwargs["frame_rate"] = rate
        call.start_image(start_image)
        call.text(prompt, negative_prompt, guidance)
        call.sampling(seed, steps, node_id)
        notes = call.announce(node_id)
        return _video_output(run(pipe, call), call.pipe, rate, notes)


def _pipeline_for(pipe: Any, start_image: torch.Tensor | None) -> Any:
    """The pipeline to call: the loaded one, or its image-to-video sibling sharing its components."""
    name = type(pipe).__name__
    image = call_params(pipe).get("image")
    if start_image is None:
        if image is not None and (image.default is inspect.Parameter.empty or "ImageToVideo" in name):
            raise ValueError(f"{name} is image-to-video: connect a start_image.")
        return pipe
    if image is not None:
        return pipe
    variant = I2V_VARIANTS.get(name)
    if variant is None:
        raise ValueError(
            f"{name} is text-to-video and takes no start image: load an image-to-video model "
            "(e.g. a Wan I2V folder) or disconnect start_image."
        )
    variant_cls = getattr(diffusers, variant)
    accepted = inspect.signature(variant_cls.__init__).parameters
    sibling = variant_cls(**{k: v for k, v in pipe.components.items() if k in accepted})
    sibling.set_progress_bar_config(**getattr(pipe, "_progress_bar_config", {}))
    log.info("start image given: running %s with the components of %s", variant, name)
    return sibling


def _default_fps(pipe: Any, family: str) -> float:
    param = call_params(pipe).get("frame_rate")
    if param is not None and isinstance(param.default, (int, float)):
        return float(param.default)
    return FAMILY_FPS.get(family, DEFAULT_FPS)


def _video_output(out: Any, pipe: Any, fps: float, notes: str) -> io.NodeOutput:
    """VIDEO of the first clip (with its audio), every frame as IMAGE, and AUDIO."""
    clips = out.frames
    images = to_image(clips)
    audio = to_audio(getattr(out, "audio", None), pipe)
    first = images[: clips.shape[1]] if clips.ndim == 5 else images
    first_audio = None if audio is None else {**audio, "waveform": audio["waveform"][:1]}
    video = InputImpl.VideoFromComponents(
        Types.VideoComponents(images=first, audio=first_audio, frame_rate=Fraction(fps).limit_denominator(1001))
    )
    return io.NodeOutput(video, images, audio, notes)


NODES: list[type[io.ComfyNode]] = [GenerateImage, GenerateVideo]

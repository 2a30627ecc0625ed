"""Pipeline results as ComfyUI's own types: IMAGE, VIDEO (with its soundtrack) and AUDIO.

Shared by every generate node, classic and modular, so that a clip, its frames and its sound
come out the same way whichever pipeline made them. A model that makes no sound still gives a
valid AUDIO (silence as long as the clip), so SaveAudio / PreviewAudio wired to it work.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch
from comfy_api.latest import InputImpl, Types, io
from PIL import Image

SILENT_RATE = 44100  # ComfyUI's own audio nodes' rate, for a model that has none


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


def to_audio(waveform: Any, sample_rate: int) -> dict[str, Any] | None:
    """ComfyUI AUDIO ``{"waveform": [B, C, T], "sample_rate"}``, or silence of the clip's length when the model made none."""
    if not isinstance(waveform, torch.Tensor):
        return None
    waveform = waveform.detach().to("cpu", torch.float32)
    if waveform.ndim == 2:
        waveform = waveform.unsqueeze(0)
    return {"waveform": waveform, "sample_rate": int(sample_rate)}


def silence(clips: int, frames: int, fps: float, sample_rate: int | None = None) -> dict[str, Any]:
    """AUDIO of ``clips`` mono silent tracks, ``frames / fps`` seconds each."""
    rate = int(sample_rate or SILENT_RATE)
    samples = round(frames * rate / fps) if fps > 0 else 0
    return {"waveform": torch.zeros(clips, 1, samples), "sample_rate": rate}


def video_output(clips: Any, audio: dict[str, Any] | None, fps: float, notes: str,
                 keep: int | None = None, silent_rate: int | None = None) -> io.NodeOutput:
    """(VIDEO, IMAGE, AUDIO, notes): every frame as IMAGE (the first ``keep`` when given), the
    first clip with the first soundtrack as VIDEO, the whole AUDIO. Without a soundtrack the
    VIDEO has none and AUDIO is silence of the clip's length (at ``silent_rate``, else 44.1 kHz)."""
    images = to_image(clips)
    if keep is not None:
        images = images[:keep]
    first = images[: clips.shape[1]] if clips.ndim == 5 else images
    first_audio = None if audio is None else {**audio, "waveform": audio["waveform"][:1]}
    video = InputImpl.VideoFromComponents(
        Types.VideoComponents(images=first, audio=first_audio, frame_rate=Fraction(fps).limit_denominator(1001))
    )
    if audio is None:
        audio = silence(clips.shape[0] if clips.ndim == 5 else 1, first.shape[0], fps, silent_rate)
    return io.NodeOutput(video, images, audio, notes)

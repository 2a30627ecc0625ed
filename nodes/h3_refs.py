"""The ref2va references of Generate (H3): images ref_1…ref_9, videos ref_video_1…3, audio ref_audio_1…3.

Why a module: the order of the references is part of the request (it numbers "<Picture i>",
"<Video k>" and "<Audio j>" in the prompt and lays the references out on the rotary clock), and
diffusers refuses bad media deep inside its setup step, after the pipeline was placed. Here the
connected inputs become diffusers' reference objects in one fixed order (images, batches expanded,
then videos with their soundtrack, then audio clips, batches expanded), and every input that the
model cannot take is refused by name before anything runs.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from comfy_api.latest import io
from diffusers.modular_pipelines.minimax_h3 import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3Reference,
    MiniMaxH3VideoReference,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

from ..offload_core.log import get_logger
from ..offload_core.models.minimax_h3 import grid as grid_rules
from .outputs import to_pil

log = get_logger("h3")

# diffusers' MiniMaxH3Ref2VASetupStep defaults (max_images, max_videos, max_audios, max_references)
MAX_VIDEOS, MAX_AUDIOS, MAX_REFERENCES = 3, 3, 12
IMAGES = tuple(f"ref_{i}" for i in range(1, grid_rules.MAX_IMAGE_REFERENCES + 1))
VIDEOS = tuple(f"ref_video_{i}" for i in range(1, MAX_VIDEOS + 1))
AUDIOS = tuple(f"ref_audio_{i}" for i in range(1, MAX_AUDIOS + 1))
ORDER = "images (ref_1…ref_9), then videos (ref_video_1…3), then audio clips (ref_audio_1…3)"
KINDS = {"image": "reference images", "video": "reference videos", "audio": "reference audio clips"}
NOUNS = {"image": "image", "video": "video", "audio": "audio clip"}


@dataclass
class References:
    """diffusers' references in the order the model reads them, and the inputs they came from."""

    items: list[MiniMaxH3Reference] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # connected inputs, in order, once each

    def count(self, kind: str) -> int:
        return sum(item.kind == kind for item in self.items)

    def named(self, kind: str) -> list[str]:
        inputs = {"image": IMAGES, "video": VIDEOS, "audio": AUDIOS}[kind]
        return [name for name in self.names if name in inputs]

    def label(self) -> str:
        """'reference images (ref_1, ref_3)', or 'references (…)' for more than one kind."""
        kinds = [kind for kind in KINDS if self.named(kind)]
        return f"{KINDS[kinds[0]] if len(kinds) == 1 else 'references'} ({', '.join(self.names)})"


def collect(inputs: dict[str, Any], audio_rate: int) -> References:
    """The connected reference inputs as diffusers' references, in ``ORDER``; bad media refused by name.
    ``audio_rate`` is the audio VAE's sample rate (another rate needs torchaudio to be resampled)."""
    refs = References()
    for name in (n for n in IMAGES if inputs.get(n) is not None):
        refs.items += [
            MiniMaxH3ImageReference(image=to_pil(frame[None])) for frame in _image(name, inputs[name])
        ]
        refs.names.append(name)
    for name in (n for n in VIDEOS if inputs.get(n) is not None):
        refs.items.append(_video(name, inputs[name], audio_rate))
        refs.names.append(name)
    for name in (n for n in AUDIOS if inputs.get(n) is not None):
        clips, rate = _clips(name, inputs[name], audio_rate)
        refs.items += [MiniMaxH3AudioReference(audio=clip, sample_rate=rate) for clip in clips]
        refs.names.append(name)
    _check_counts(refs, inputs)
    if refs.items:
        log.debug("ref2va references: %s", ", ".join(_describe(item) for item in refs.items))
    return refs


def _image(name: str, images: torch.Tensor) -> torch.Tensor:
    height, width = images.shape[1:3]
    if not 0.25 <= width / height <= 4.0:
        raise ValueError(
            f"{name} is {width}×{height}; MiniMax-H3 takes reference images within 1:4 and 4:1: crop it"
        )
    return images


def _video(name: str, video: Any, audio_rate: int) -> MiniMaxH3VideoReference:
    """A VIDEO (ComfyUI's VideoInput) as a video reference at its own frame rate, with its soundtrack."""
    parts = video.get_components()
    images = parts.images
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or 0 in images.shape[:3]:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"{name} has no frames ({shape}): connect a video with at least one frame")
    fps = float(parts.frame_rate or 0)
    if not fps > 0:
        raise ValueError(
            f"{name} has a frame rate of {parts.frame_rate}: MiniMax-H3 needs the rate the frames run at"
        )
    height, width = images.shape[1:3]
    if not 0.25 <= width / height <= 4.0:
        raise ValueError(
            f"{name} is {width}×{height}; MiniMax-H3 takes reference videos within 1:4 and 4:1: crop it"
        )
    # uint8 (T, 3, H, W): diffusers rounds float frames the same way, at a quarter of the memory
    frames = (images[..., :3].to(torch.float32).clamp(0, 1) * 255).round().to(torch.uint8).movedim(-1, 1)
    if parts.audio is None:
        return MiniMaxH3VideoReference(frames=frames.contiguous(), fps=fps)
    (soundtrack,), rate = _clips(f"{name}'s soundtrack", parts.audio, audio_rate, single=True)
    return MiniMaxH3VideoReference(frames=frames.contiguous(), fps=fps, audio=soundtrack, sample_rate=rate)


def _clips(name: str, audio: Any, audio_rate: int, single: bool = False) -> tuple[list[torch.Tensor], int]:
    """An AUDIO ``{"waveform": [B, C, T], "sample_rate"}`` as B ``(C, T)`` float32 clips and their rate."""
    waveform, rate = audio.get("waveform"), int(audio.get("sample_rate") or 0)
    if not isinstance(waveform, torch.Tensor) or waveform.ndim != 3:
        shape = tuple(waveform.shape) if isinstance(waveform, torch.Tensor) else type(waveform).__name__
        raise ValueError(f"{name} is not ComfyUI audio (a [batch, channels, samples] waveform, got {shape})")
    batch, channels, samples = waveform.shape
    if rate <= 0:
        raise ValueError(
            f"{name} has a sample rate of {audio.get('sample_rate')}: MiniMax-H3 needs the rate the "
            "samples run at"
        )
    if batch == 0 or samples == 0:
        raise ValueError(
            f"{name} holds no samples ({batch} clips of {samples}): connect audio with sound in it"
        )
    if channels not in (1, 2):
        raise ValueError(f"{name} has {channels} channels; MiniMax-H3 takes mono or stereo: mix it down")
    if single and batch != 1:
        raise ValueError(f"{name} holds {batch} clips; a video carries one soundtrack")
    if rate != audio_rate and importlib.util.find_spec("torchaudio") is None:
        raise ValueError(
            f"{name} is at {rate} Hz; the audio VAE takes {audio_rate} Hz and resampling needs "
            f"torchaudio, which is not installed: install it, or resample the audio to {audio_rate} Hz"
        )
    return list(waveform.detach().to("cpu", torch.float32)), rate


def _check_counts(refs: References, inputs: dict[str, Any]) -> None:
    """Per kind and in all, the counts diffusers' setup step allows."""
    for kind, limit, names in (
        ("image", grid_rules.MAX_IMAGE_REFERENCES, IMAGES),
        ("audio", MAX_AUDIOS, AUDIOS),
    ):
        if refs.count(kind) > limit:
            counts = ", ".join(f"{n}: {_batch(kind, inputs[n])}" for n in names if inputs.get(n) is not None)
            raise ValueError(
                f"{refs.count(kind)} {KINDS[kind]} are connected ({counts}); MiniMax-H3 takes at most "
                f"{limit}: disconnect some or pass smaller batches"
            )
    if len(refs.items) > MAX_REFERENCES:
        counts = ", ".join(_plural(refs.count(kind), NOUNS[kind]) for kind in KINDS if refs.count(kind))
        raise ValueError(
            f"{len(refs.items)} references are connected ({counts}); MiniMax-H3 takes at most "
            f"{MAX_REFERENCES} in all: disconnect some"
        )
    if refs.items and not (refs.count("image") or refs.count("video")):
        raise ValueError(
            f"{refs.label()} without a reference image or video: MiniMax-H3 pairs reference audio with at "
            "least one of them; connect ref_1 or ref_video_1 too"
        )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _batch(kind: str, value: Any) -> int:
    return len(value) if kind == "image" else int(value["waveform"].shape[0])


def _describe(item: MiniMaxH3Reference) -> str:
    if isinstance(item, MiniMaxH3ImageReference):
        return f"image {item.image.size[0]}×{item.image.size[1]}"
    if isinstance(item, MiniMaxH3VideoReference):
        sound = f" + sound at {item.sample_rate} Hz" if item.audio is not None else ""
        return f"video {tuple(item.frames.shape)} at {item.fps:g} fps{sound}"
    return f"audio {tuple(item.audio.shape)} at {item.sample_rate} Hz"


def check_video_lengths(pipe: Any, refs: References, fps: int, frames: int) -> None:
    """A video reference resampled to the model's rate and cut to the clip must still give the
    conditioner one group of frames (at 2 fps in pairs: 13 frames at 24 fps), else diffusers fails deep."""
    videos = [item for item in refs.items if isinstance(item, MiniMaxH3VideoReference)]
    if not videos:
        return
    stride = fps / _video_sample_fps(pipe)
    patch = int(
        getattr(getattr(getattr(pipe, "processor", None), "video_processor", None), "temporal_patch_size", 2)
    )
    minimum = round((patch - 1) * stride) + 1
    for name, video in zip(refs.named("video"), videos, strict=True):
        count = min(resampled_frames(video, fps), frames)
        if frames == 1:
            raise ValueError(
                f"{name} cannot condition a still (frames = 1): MiniMax-H3 reads a reference video in groups of "
                f"at least {minimum} frames at {fps} fps; render a clip, or disconnect {name}"
            )
        if count < minimum:
            raise ValueError(
                f"{name} gives {count} frames at {fps} fps; MiniMax-H3 reads a reference video in groups that "
                f"need at least {minimum} frames at {fps} fps ({minimum / fps:.2g} s): connect a longer video"
            )


def resampled_frames(video: MiniMaxH3VideoReference, fps: int) -> int:
    """Frames a video reference has at ``fps`` (diffusers drops or repeats whole frames)."""
    count = video.frames.shape[0]
    return count if video.fps == fps else math.floor(count * fps / video.fps + 0.5)


def _video_sample_fps(pipe: Any) -> float:
    """The rate the conditioner reads reference videos at: the text encoder block's ``video_sample_fps``."""
    pending = [pipe.blocks]
    while pending:
        block = pending.pop()
        if hasattr(block, "video_sample_fps"):
            return float(block.video_sample_fps)
        pending += list((getattr(block, "sub_blocks", None) or {}).values())
    return 2.0


def encode_units(pipe: Any, grid: grid_rules.H3Grid, refs: References, frames: int) -> int:
    """Video VAE encoder calls for the references (the image encode stage's total): an image one
    still at its own size; a video resampled, cut to the clip, snapped down to 17n+5 and put on
    the canvas its own aspect resolves to, then encoded chunk by chunk."""
    vae = pipe.vae
    sizes = [item.image.size for item in refs.items if isinstance(item, MiniMaxH3ImageReference)]
    units = grid_rules.reference_units(vae, grid, grid_rules.reference_short_edge(pipe), sizes)
    clip = int(getattr(vae.config, "clip_length", grid.frames_per_chunk))
    for video in (item for item in refs.items if isinstance(item, MiniMaxH3VideoReference)):
        count = min(resampled_frames(video, grid.fps), frames)
        per, extra = grid.frames_per_chunk, grid.latents_per_chunk
        encoded = min(count, max(1, (count - extra) // per) * per + extra)
        height, width = resolve_canvas_size(
            video.frames.shape[-1], video.frames.shape[-2], grid.multiple, grid.short_edge, grid.max_pixels
        )
        units += math.ceil(encoded / clip) * grid_rules.tiles(vae, height, width)
    return units


def inputs() -> list[io.Input]:
    """The optional reference sockets, last in the node's inputs (a workflow saved before keeps its links)."""
    ref2va = "needs the pipeline loaded with workflow ref2va"
    order = f"The model reads the references in this order: {ORDER}"
    return [
        *(
            io.Image.Input(
                name,
                optional=True,
                tooltip=(
                    f"Reference image {i} for ref2va (subject, style or scene; {ref2va}): <Picture {i}>, … of the prompt. "
                    f"{order}; each image of a batch is a reference of its own; at most {len(IMAGES)} images, each within "
                    "1:4 and 4:1, encoded at its own aspect."
                ),
            )
            for i, name in enumerate(IMAGES, 1)
        ),
        *(
            io.Video.Input(
                name,
                optional=True,
                tooltip=(
                    f"Reference video {i} for ref2va (motion and camera; {ref2va}): <Video {i}> of the prompt, at its own "
                    f"frame rate, with its soundtrack when it has one. {order}; at least 0.54 s, at most {MAX_VIDEOS} "
                    f"videos, {MAX_REFERENCES} references in all."
                ),
            )
            for i, name in enumerate(VIDEOS, 1)
        ),
        *(
            io.Audio.Input(
                name,
                optional=True,
                tooltip=(
                    f"Reference audio {i} for ref2va (voice or music; {ref2va}, and a reference image or video beside it): "
                    f"<Audio {i}> of the prompt, mono or stereo at its own sample rate. {order}; each clip of a batch is a "
                    f"reference of its own; at most {MAX_AUDIOS} clips, {MAX_REFERENCES} references in all."
                ),
            )
            for i, name in enumerate(AUDIOS, 1)
        ),
    ]

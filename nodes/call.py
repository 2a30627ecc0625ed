"""Assembling a classic pipeline's call from a node's inputs, with notes of what was changed.

Why: every diffusers pipeline takes its own arguments. A `Call` offers the negative prompt,
guidance, batch size and frame rate only where the pipeline's ``__call__`` takes them, snaps
sizes to the model's grid, and notes each change or omission for the user instead of failing.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import diffusers
import torch

from ..offload_core.components import denoiser
from .grid import Grid, snap_frames, snap_size
from .outputs import to_pil

log = logging.getLogger("diffusers_offload.nodes")

# Playback rate of models whose call takes no frame rate; the call's own default wins otherwise.
FAMILY_FPS = {"wan": 16.0}
DEFAULT_FPS = 24.0
# Text-to-video pipelines whose components also run image-to-video under a sibling class, and back.
I2V_VARIANTS = {
    "LTX2Pipeline": "LTX2ImageToVideoPipeline",
    "LTXPipeline": "LTXImageToVideoPipeline",
    "WanPipeline": "WanImageToVideoPipeline",
}
T2V_VARIANTS = {"WanImageToVideoPipeline": "WanPipeline"}
# The pipeline config flag without which a class's components run one mode only. Wan: only the
# TI2V-5B layout (``expand_timesteps``: the start image's latents replace the first latent frame)
# runs both; Wan 2.1 / 2.2 A14B transformers take 16 channels (T2V) or 36 (I2V), never both.
BOTH_MODES_FLAG = {"WanPipeline": "expand_timesteps", "WanImageToVideoPipeline": "expand_timesteps"}
# Image pipelines that take several reference images (a list) / that cannot run without one.
MULTI_REFERENCE = {"Flux2Pipeline", "Flux2KleinPipeline", "QwenImageEditPlusPipeline"}
NEEDS_REFERENCE = {"QwenImageEditPipeline", "QwenImageEditPlusPipeline"}
EDIT_HINT = "load an image-editing model (FLUX.2, Qwen-Image-Edit, FLUX.1 Kontext)"

def call_params(pipe: Any) -> Mapping[str, inspect.Parameter]:
    """The keyword arguments the pipeline's ``__call__`` takes."""
    return inspect.signature(pipe.__call__).parameters


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

    def require(self, *names: str, hint: str) -> None:
        missing = [n for n in names if not self.takes(n)]
        if missing:
            raise ValueError(f"{self.name} takes no {', '.join(missing)}: {hint}")

    def size(self, grid: Grid, width: int, height: int) -> None:
        """Width and height snapped to the grid; a pipeline that rescales to an area (FLUX.1
        Kontext: 1024² by default) gets theirs, so the image is the size asked for."""
        for name, value in (("width", width), ("height", height)):
            snapped = snap_size(value, grid.spatial)
            if snapped != value:
                self.notes.append(f"{name} {value} → {snapped} (multiple of {grid.spatial} for {self.name})")
            self.kwargs[name] = snapped
        if self.takes("max_area"):
            self.kwargs["max_area"] = self.kwargs["width"] * self.kwargs["height"]

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

    def references(self, batches: list[torch.Tensor]) -> None:
        """An image pipeline's reference images (``image``): every image of the batches, in order,
        for a pipeline that takes several, else the first with a note. Refused by name where the
        pipeline takes none, or needs one and none is connected."""
        if not batches:
            if self.name in NEEDS_REFERENCE:
                raise ValueError(f"{self.name} edits an image: connect reference_images.")
            return
        if not self.takes("image"):
            raise ValueError(f"{self.name} takes no reference image: {EDIT_HINT}, or disconnect reference_images.")
        pictures = [to_pil(batch[i : i + 1]) for batch in batches for i in range(batch.shape[0])]
        if self.name in MULTI_REFERENCE:
            self.kwargs["image"] = pictures
            return
        self.kwargs["image"] = pictures[0]
        if len(pictures) > 1:
            self.notes.append(f"reference_images: {self.name} takes one, the first of {len(pictures)} is used")

    def text(self, prompt: str, negative_prompt: str, guidance: float) -> None:
        """The prompts and guidance. A true-CFG pipeline (Flux without distilled guidance, Qwen-Image)
        runs CFG only when given a negative prompt: with guidance above 1 an empty one is passed, as
        ComfyUI's sampler runs CFG against an empty negative."""
        self.kwargs["prompt"] = prompt
        key = self.guidance_key() if guidance > 0 else None
        if negative_prompt.strip() or (key == "true_cfg_scale" and guidance > 1):
            self.offer("negative_prompt", negative_prompt, f"{self.name} takes no negative prompt: ignored")
        if key is not None:
            self.offer(key, guidance, f"{self.name} takes no guidance scale: ignored")

    def second_guidance(self, guidance_2: float) -> None:
        """Wan 2.2 A14B's guidance for its second expert (``transformer_2``, below the pipeline's
        ``boundary_ratio``); 0 leaves it as the first's. A pipeline with one denoiser notes it ignored."""
        if guidance_2 <= 0:
            return
        if self.takes("guidance_scale_2") and getattr(self.pipe.config, "boundary_ratio", None) is not None:
            self.kwargs["guidance_scale_2"] = guidance_2
        else:
            self.notes.append(f"{self.name} has one denoiser: guidance_2 ignored")

    @contextmanager
    def expert_split(self, steps: int, high: int) -> Iterator[None]:
        """Wan 2.2 A14B: its high-noise expert runs the first ``high`` of ``steps`` (0: as the
        pipeline's ``boundary_ratio`` splits them), as ComfyUI's two-sampler workflows split them.
        diffusers switches experts at a timestep, so the ratio is set for this call between the
        two steps' timesteps (the scheduler's own for ``steps``), and restored after it."""
        ratio = getattr(self.pipe.config, "boundary_ratio", None)
        if high <= 0 or ratio is None:
            if high > 0:
                self.notes.append(f"{self.name} has one denoiser: high_noise_steps ignored")
            yield
            return
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(steps)
        times = [float(t) for t in scheduler.timesteps]
        cut = (times[high - 1] + times[high]) / 2 if high < len(times) else 0.0
        self.pipe.register_to_config(boundary_ratio=cut / scheduler.config.num_train_timesteps)
        try:
            yield
        finally:
            self.pipe.register_to_config(boundary_ratio=ratio)

    def guidance_key(self) -> str:
        """``true_cfg_scale`` where the pipeline has real CFG beside a ``guidance_scale`` that only a
        guidance-distilled denoiser reads (Flux, Qwen-Image); ``guidance_scale`` everywhere else."""
        config = getattr(denoiser(self.pipe), "config", None) or {}
        distilled = bool(config.get("guidance_embeds"))
        return "true_cfg_scale" if self.takes("true_cfg_scale") and not distilled else "guidance_scale"

    def sampling(self, seed: int, steps: int) -> None:
        """Steps and a CPU generator (same seed, same image on every device); a distilled LTX-2's
        own sigmas where the steps are its own."""
        self.kwargs.update(
            num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed), output_type="pt"
        )
        sigmas = distilled_sigmas(self.pipe)
        if sigmas is None:
            return
        if steps == len(sigmas) and self.takes("sigmas"):
            self.kwargs["sigmas"] = sigmas
            self.notes.append(f"{self.name}: a distilled model: its {len(sigmas)} trained sigmas")
        else:
            self.notes.append(f"{self.name}: a distilled model, trained for {len(sigmas)} steps at its own sigmas; "
                              f"{steps} steps run on the scheduler's plain schedule")


LTX2_SHIFTS = {"base_shift": 0.95, "max_shift": 2.05}  # LTX-2's scheduler values (diffusers' conversion script)


def distilled_sigmas(pipe: Any) -> list[float] | None:
    """LTX-2 distilled's fixed schedule (diffusers' ``DISTILLED_SIGMA_VALUES``) for an LTX-2 pipeline
    whose scheduler is the distilled model's (LTX-2's shifts, no dynamic shifting: the config
    diffusers' conversion writes for it and the pack carries), else None: that scheduler alone
    would space 8 steps evenly, not as the model was distilled."""
    config = dict(getattr(getattr(pipe, "scheduler", None), "config", None) or {})
    if not type(pipe).__name__.startswith("LTX2") or config.get("use_dynamic_shifting", True):
        return None
    if any(config.get(k) != v for k, v in LTX2_SHIFTS.items()):
        return None
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

    return list(DISTILLED_SIGMA_VALUES)


def pipeline_for(pipe: Any, start_image: torch.Tensor | None) -> Any:
    """The pipeline to call: the loaded one, or its text- or image-to-video sibling sharing its
    components and its config flags."""
    name = type(pipe).__name__
    image = call_params(pipe).get("image")
    if start_image is None:
        if image is None or (image.default is not inspect.Parameter.empty and "ImageToVideo" not in name):
            return pipe
        variant = _variant(pipe, T2V_VARIANTS)
        if variant is None:
            raise ValueError(f"{name} is image-to-video: connect a start_image.")
        return _sibling(pipe, variant, "no start image")
    if image is not None:
        return pipe
    variant = _variant(pipe, I2V_VARIANTS)
    if variant is None:
        raise ValueError(
            f"{name} is text-to-video and takes no start image: load an image-to-video model "
            "(e.g. a Wan I2V folder) or disconnect start_image."
        )
    return _sibling(pipe, variant, "start image given")


def _variant(pipe: Any, table: Mapping[str, str]) -> str | None:
    """The sibling class for the other mode, when this pipeline's components run it."""
    name = type(pipe).__name__
    flag = BOTH_MODES_FLAG.get(name)
    if flag is not None and not _config(pipe).get(flag):
        return None
    return table.get(name)


def _config(pipe: Any) -> Mapping[str, Any]:
    """The pipeline's registered config (read as a mapping: attribute access to it warns)."""
    config = getattr(pipe, "config", None)
    return config if isinstance(config, Mapping) else {}


def _sibling(pipe: Any, variant: str, why: str) -> Any:
    """``variant`` built on the pipeline's components and its config flags (``expand_timesteps``,
    ``boundary_ratio``): the components alone would build it with the class defaults, and a Wan
    TI2V-5B image-to-video sibling without ``expand_timesteps`` feeds 100 channels to a
    48-channel transformer."""
    cls = getattr(diffusers, variant)
    accepted = inspect.signature(cls.__init__).parameters
    components = pipe.components
    flags = {k: v for k, v in _config(pipe).items() if k in accepted and k not in components and not k.startswith("_")}
    sibling = cls(**{k: v for k, v in components.items() if k in accepted}, **flags)
    sibling.set_progress_bar_config(**getattr(pipe, "_progress_bar_config", {}))
    log.info("%s: running %s with the components and flags of %s", why, variant, type(pipe).__name__)
    return sibling

def default_fps(pipe: Any, family: str) -> float:
    """The call's own default frame rate, else the family's, else 24."""
    param = call_params(pipe).get("frame_rate")
    if param is not None and isinstance(param.default, (int, float)):
        return float(param.default)
    return FAMILY_FPS.get(family, DEFAULT_FPS)


def sample_rate(pipe: Any) -> int:
    """Rate of the waveform the pipeline returns (the vocoder's output rate when there is one)."""
    vocoder = getattr(pipe, "vocoder", None)
    rate = getattr(getattr(vocoder, "config", None), "output_sampling_rate", None)
    return int(rate or getattr(pipe, "audio_sampling_rate", 16000))

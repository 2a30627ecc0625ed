"""MiniMax-H3 through diffusers' ModularPipeline: load a modular folder per workflow, generate.

Why: H3 is modular only (no classic pipeline), its workflows load different components (the
t2va/fl2va transformer or the ref2va one, 62 GB each), and a run has choices the loaded model
must not keep (audio off, a single still). Loading fetches only the chosen workflow's components;
each run goes through a run view (``offload_core.models.minimax_h3.run_view``) over the same placed components, with
stage hooks (``offload_core.run.stages``) driving the progress bar, the node's label and Cancel.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from comfy_api.latest import InputImpl, Types, io
from diffusers.modular_pipelines import ModularPipeline

from ..offload_core import OffloadConfig
from ..offload_core.models.minimax_h3 import grid as grid_rules
from ..offload_core.models.minimax_h3.run_view import pad_short_latents, run_view
from ..offload_core.run.stages import DENOISE, IMAGE, VIDEO, StageHooks
from . import host
from .generate import NOTES, SEED_MAX, to_image, to_pil
from .loaders import DTYPES, MODULAR_INDEX, PipelineFolderError, check_component, list_models, resolve_model
from .progress import say, stage_host
from .types import CATEGORY, DiffusersPipe, OffloadConfigType, PipeHandle, family_of

log = logging.getLogger("diffusers_offload.nodes")

WORKFLOWS = ("t2va", "fl2va", "ref2va")
REF_FOLDER = "transformer_ref"


# -------------------------------------------------------------------------------------- loading
def list_modular_models() -> list[str]:
    """Listed model folders that hold a modular index."""
    return [name for name in list_models() if (resolve_model(name) / MODULAR_INDEX).is_file()]


def load_modular(folder: Path, workflow: str, dtype: torch.dtype) -> ModularPipeline:
    """The pipeline pruned to ``workflow``, with only that workflow's components checked and loaded."""
    if not (folder / MODULAR_INDEX).is_file():
        raise PipelineFolderError(f"{folder} has no {MODULAR_INDEX}: it is not a modular pipeline; load a classic "
                                  "one (model_index.json) with 'Load diffusers pipeline'")
    if workflow == "ref2va" and not (folder / REF_FOLDER).is_dir():
        raise PipelineFolderError(f"workflow ref2va needs {folder / REF_FOLDER}, which is missing: choose t2va or "
                                  "fl2va, or download the transformer_ref folder")
    try:
        pipe = ModularPipeline.from_pretrained(str(folder), workflow=workflow, local_files_only=True)
    except Exception as exc:  # unknown workflow, unreadable index: name the folder
        raise PipelineFolderError(f"diffusers could not read {folder} for workflow {workflow!r}: "
                                  f"{type(exc).__name__}: {exc}") from exc
    for name, spec in pipe._component_specs.items():
        source = getattr(spec, "pretrained_model_name_or_path", None)
        if spec.default_creation_method == "from_pretrained" and source and Path(source).is_dir():
            check_component(Path(source) / (spec.subfolder or ""), name, getattr(spec.type_hint, "__name__", "?"))
    try:
        pipe.load_components(dtype=dtype)
    except Exception as exc:
        raise PipelineFolderError(f"diffusers could not load the {workflow} components of {folder}: "
                                  f"{type(exc).__name__}: {exc}") from exc
    log.info("loaded %s (%s) from %s (%s)", type(pipe).__name__, workflow, folder, str(dtype).removeprefix("torch."))
    return pipe


class LoadModularPipeline(io.ComfyNode):
    """Load a modular diffusers pipeline (modular_model_index.json) for one workflow."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadLoadModularPipeline",
            display_name="Load modular pipeline (diffusers)",
            category=CATEGORY,
            description="Loads a modular diffusers pipeline folder (modular_model_index.json, e.g. MiniMax-H3) "
                        "from models/diffusers with only the components the chosen workflow uses.",
            inputs=[
                io.Combo.Input("model", options=list_modular_models(),
                               tooltip="A folder under models/diffusers holding modular_model_index.json."),
                io.Combo.Input("workflow", options=list(WORKFLOWS), default="t2va",
                               tooltip="t2va: text to video+audio; fl2va: also first and/or last frame; "
                                       "ref2va: needs the transformer_ref folder."),
                io.Combo.Input("dtype", options=list(DTYPES), default="auto",
                               tooltip="Weight dtype; auto picks what ComfyUI would for the device."),
                OffloadConfigType.Input("offload", optional=True, tooltip="Offload settings."),
            ],
            outputs=[DiffusersPipe.Output(display_name="pipe")],
        )

    @classmethod
    def execute(cls, model: str, workflow: str, dtype: str, offload: OffloadConfig | None = None) -> io.NodeOutput:
        config = offload or OffloadConfig()
        folder = resolve_model(model)
        torch_dtype = DTYPES[dtype] or host.auto_dtype(config)
        pipe = load_modular(folder, workflow, torch_dtype)
        handle = PipeHandle(pipe=pipe, config=config, path=str(folder), family=family_of(pipe),
                            dtype=torch_dtype, patcher=host.manage(pipe, torch_dtype, config))
        return io.NodeOutput(handle)


# ------------------------------------------------------------------------------------- generate
def _takes(pipe: Any) -> set[str]:
    return {param.name for param in pipe.blocks.inputs}


def _check_workflow(pipe: Any, keyframes: int) -> None:
    takes = _takes(pipe)
    if "references" in takes:
        raise ValueError("this pipeline is loaded for ref2va, which needs reference inputs Generate (H3) does not "
                         "offer yet: load it with workflow t2va or fl2va")
    if keyframes and "image" not in takes:
        raise ValueError("a first or last frame is connected but the pipeline is loaded for t2va: load it with "
                         "workflow fl2va, or disconnect the frames")
    if not keyframes and "image" in takes:
        raise ValueError("the pipeline is loaded for fl2va, which needs a first or last frame: connect one, or "
                         "load it with workflow t2va")


def _frames_asked(frames: int, duration: float, fps: int, notes: list[str]) -> int:
    if duration <= 0:
        return frames
    asked = max(round(duration * fps), 1)
    notes.append(f"duration {duration:g} s → {asked} frames at {fps} fps")
    return asked


class GenerateH3(io.ComfyNode):
    """Text (and first/last frame) to video with audio on a loaded MiniMax-H3 modular pipeline."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadGenerateH3",
            display_name="Generate video + audio (MiniMax-H3)",
            category=CATEGORY,
            description="Runs MiniMax-H3 (t2va, or fl2va with a first and/or last frame). Canvas and frames are "
                        "snapped to the model's grid with a note; frames = 1 renders a single still image.",
            inputs=[
                DiffusersPipe.Input("pipe", tooltip="A pipeline from 'Load modular pipeline'."),
                io.String.Input("prompt", multiline=True, default=""),
                io.Int.Input("seed", default=0, min=0, max=SEED_MAX, control_after_generate=True),
                io.Int.Input("steps", default=30, min=2, max=1000,
                             tooltip="Points of H3's sigma grid, the final 0 included: the model runs steps − 1 times."),
                io.Int.Input("width", default=1344, min=16, max=8192, step=16,
                             tooltip="Snapped to multiples of 32, area at most 768×1344, aspect 1:4 to 4:1."),
                io.Int.Input("height", default=768, min=16, max=8192, step=16,
                             tooltip="Snapped to multiples of 32, area at most 768×1344, aspect 1:4 to 4:1."),
                io.Int.Input("frames", default=124, min=1, max=1000,
                             tooltip="At 24 fps; snapped up to 17n+5 within 5–15 s (124…345). 1: a still image."),
                io.Float.Input("duration", default=0.0, min=0.0, max=60.0, step=0.1,
                               tooltip="Seconds; when above 0 it sets the frame count instead of frames."),
                io.Boolean.Input("generate_audio", default=True,
                                 tooltip="Off: the audio decode block is removed (no audio decode, no muxing)."),
                io.Int.Input("vae_scale_factor", default=0, min=0, max=64,
                             tooltip="Override of the video VAE's spatial compression; 0: the VAE's own."),
                io.Image.Input("first_frame", optional=True, tooltip="Keyframe the video starts from (fl2va)."),
                io.Image.Input("last_frame", optional=True, tooltip="Keyframe the video ends on (fl2va)."),
            ],
            outputs=[
                io.Video.Output("video", display_name="video"),
                io.Image.Output("images", display_name="frames"),
                io.Audio.Output("audio", display_name="audio", tooltip="None when audio is off or for a still."),
                NOTES,
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(
        cls, pipe: PipeHandle, prompt: str, seed: int, steps: int, width: int, height: int, frames: int,
        duration: float, generate_audio: bool, vae_scale_factor: int, first_frame: torch.Tensor | None = None,
        last_frame: torch.Tensor | None = None,
    ) -> io.NodeOutput:
        node_id = cls.hidden.unique_id
        h3 = pipe.pipe
        if pipe.family != "minimax_h3":
            raise ValueError(f"{type(h3).__name__} is not MiniMax-H3: use 'Generate video (diffusers)' for it")
        keyframes = {k: to_pil(v) for k, v in (("image", first_frame), ("last_image", last_frame)) if v is not None}
        _check_workflow(h3, len(keyframes))
        grid = grid_rules.grid_of(h3, vae_scale_factor)
        width, height, notes = grid_rules.snap_canvas(grid, width, height)
        frames, frame_notes = grid_rules.snap_frames(grid, _frames_asked(frames, duration, grid.fps, notes))
        notes += frame_notes
        still = frames == 1
        if still and generate_audio:
            notes.append("a still has no soundtrack: audio off for this run")
        with_audio = generate_audio and not still
        text = "\n".join(notes)
        if text:
            say(text, node_id)

        vae = h3.vae
        totals = {
            DENOISE: steps - 1,  # H3's scheduler takes grid points; the last one is the terminal 0
            VIDEO: grid_rules.decode_units(vae, grid.latent_frames(frames), height, width),
            IMAGE: grid_rules.encode_units(vae, len(keyframes), height, width),
        }
        view = run_view(h3, audio=with_audio, still=still, vae_scale_factor=vae_scale_factor)
        kwargs = dict(prompt=prompt, height=height, width=width, num_frames=frames, num_inference_steps=steps,
                      generator=torch.Generator("cpu").manual_seed(seed), output_type="pt", **keyframes)
        pipe.prepare()
        try:
            with ExitStack() as stack:
                stack.enter_context(StageHooks(h3, stage_host(node_id, h3), totals))
                stack.enter_context(pad_short_latents(vae))
                state = view(**kwargs)
        finally:
            pipe.finish()
        return _outputs(state, grid.fps, frames if still else None, with_audio, text)


def _outputs(state: Any, fps: int, keep: int | None, with_audio: bool, notes: str) -> io.NodeOutput:
    """VIDEO (with the soundtrack when there is one), IMAGE frames, AUDIO, notes."""
    images = to_image(state.get("videos"))
    if keep is not None:
        images = images[:keep]
    sound = None
    if with_audio:
        waveform = state.get("audio").detach().to("cpu", torch.float32)
        sound = {"waveform": waveform, "sample_rate": int(state.get("sampling_rate"))}
    video = InputImpl.VideoFromComponents(Types.VideoComponents(images=images, audio=sound, frame_rate=Fraction(fps)))
    return io.NodeOutput(video, images, sound, notes)


NODES: list[type[io.ComfyNode]] = [LoadModularPipeline, GenerateH3]

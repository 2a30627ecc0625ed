"""Load diffusers pipeline / Load modular pipeline: a checked folder, loaded as a `PipeHandle`.

Why two loaders: a classic pipeline (``model_index.json``) loads whole; a modular one
(``modular_model_index.json``, MiniMax-H3) loads only the components of the chosen workflow (the
t2va/fl2va transformer or the ref2va one, 62 GB each). Both hand ComfyUI one managed patcher
(``host.manage``); weights stay in host memory until a run places them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import folder_paths
import torch
from comfy_api.latest import io
from diffusers import DiffusionPipeline
from diffusers.modular_pipelines import ModularPipeline

from ..offload_core import OffloadConfig
from ..offload_core.components import denoisers, iter_modules
from ..offload_core.formats import carried
from ..offload_core.formats.fp8 import FP8_DTYPES, store_fp8
from ..offload_core.formats.mapped import MappedFileError, map_from_files
from ..offload_core.formats.single_file import load_denoiser
from ..offload_core.models.minimax_h3.audio_vae_file import load_audio_vae_file
from ..offload_core.models.minimax_h3.carried_parts import tokenizer_and_processor
from ..offload_core.models.minimax_h3.conditioner import load_conditioner_file, trim_conditioner
from ..offload_core.models.minimax_h3.vae_file import load_vae_file
from . import host
from .folders import (
    MODULAR_INDEX,
    PipelineFolderError,
    check_component,
    check_pipeline_folder,
    list_models,
    list_modular_models,
    read_json,
    resolve_model,
)
from .model_files import DENOISER_FOLDERS, NONE, PACK, comfy_package, denoiser_files, optional
from .types import CATEGORY, DiffusersPipe, OffloadConfigType, PipeHandle, family_of
from .web_api import search_aliases

log = logging.getLogger("diffusers_offload.nodes")

FAST = "fp8_e4m3fn_fast"  # ComfyUI's weight_dtype of that name
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    **FP8_DTYPES,  # the denoisers' Linear weights stored in fp8, computing in the auto dtype
    FAST: torch.float8_e4m3fn,  # and computing through fp8 matmuls where the device has them
}
WORKFLOWS = ("t2va", "fl2va", "ref2va")
REF_FOLDER = "transformer_ref"
FILE_INPUTS = {"transformer": "transformer_file", REF_FOLDER: "transformer_file", "text_encoder": "text_encoder_file",
               "vae": "vae_file", "audio_vae": "audio_vae_file"}


def load_pipeline(folder: Path, dtype: torch.dtype) -> DiffusionPipeline:
    check_pipeline_folder(folder)
    try:
        pipe = DiffusionPipeline.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    except Exception as exc:  # diffusers' own errors rarely say which folder they came from
        raise PipelineFolderError(f"diffusers could not load {folder}: {type(exc).__name__}: {exc}") from exc
    log.info("loaded %s from %s (%s)", type(pipe).__name__, folder, str(dtype).removeprefix("torch."))
    return pipe


def load_modular(folder: Path, workflow: str, dtype: torch.dtype, transformer_file: Path | None = None,
                 text_encoder_file: Path | None = None, vae_file: Path | None = None,
                 audio_vae_file: Path | None = None, comfy_tokenizers: Path | None = None) -> ModularPipeline:
    """The pipeline pruned to ``workflow``, with only that workflow's components checked and loaded;
    with ``transformer_file`` (a ComfyUI single file: bf16, fp8, W4A8, W4A4, NVFP4, MXFP8, GGUF), the workflow's
    transformer (ref2va's ``transformer_ref``) comes from it, into the folder's config for it (the
    folder's weights are not read); with ``text_encoder_file`` (MiniMax-H3's conditioner in ComfyUI's
    layout or transformers'), the text encoder likewise, ``vae_file`` / ``audio_vae_file`` (H3's
    VAEs, ComfyUI's layout or diffusers') the VAEs. A folder the pack carries (configs only) takes
    every model from a file, its tokenizer from ComfyUI's ``comfy_tokenizers`` folder. H3's
    conditioner keeps the layers it is read at (`trim_conditioner`)."""
    if not (folder / MODULAR_INDEX).is_file():
        raise PipelineFolderError(f"{folder} has no {MODULAR_INDEX}: it is not a modular pipeline; load a classic "
                                  "one (model_index.json) with 'Load diffusers pipeline'")
    if workflow == "ref2va" and not (folder / REF_FOLDER).is_dir():
        raise PipelineFolderError(f"workflow ref2va needs {folder / REF_FOLDER}, which is missing: choose t2va or "
                                  "fl2va, or download the transformer_ref folder")
    read_json(folder / MODULAR_INDEX)  # a broken index is named with the parser's position, as for classic ones
    try:
        pipe = ModularPipeline.from_pretrained(str(folder), workflow=workflow, local_files_only=True)
    except Exception as exc:  # unknown workflow, unreadable index: name the folder
        raise PipelineFolderError(f"diffusers could not read {folder} for workflow {workflow!r}: "
                                  f"{type(exc).__name__}: {exc}") from exc
    denoiser = REF_FOLDER if workflow == "ref2va" else "transformer"
    files = {denoiser: transformer_file, "text_encoder": text_encoder_file, "vae": vae_file,
             "audio_vae": audio_vae_file}
    shipped = tokenizer_and_processor(folder, comfy_tokenizers) if (folder / carried.SHIPPED).is_file() else {}
    _check_sources(pipe, folder, {**files, **shipped})
    if transformer_file is not None:  # set first: load_components then loads only what is missing
        pipe.update_components(**{denoiser: load_denoiser(transformer_file, folder, dtype, subfolder=denoiser)})
    if text_encoder_file is not None:
        pipe.update_components(text_encoder=_conditioner(pipe, folder, text_encoder_file, dtype))
    if vae_file is not None:
        _require_h3(pipe, folder, "vae", "video VAE")
        pipe.update_components(vae=load_vae_file(vae_file, folder / "vae", dtype))
    if audio_vae_file is not None:
        _require_h3(pipe, folder, "audio_vae", "audio VAE")
        pipe.update_components(audio_vae=load_audio_vae_file(audio_vae_file, folder / "audio_vae", dtype))
    if shipped:
        pipe.update_components(**shipped)
    try:
        pipe.load_components(dtype=dtype)
    except Exception as exc:
        raise PipelineFolderError(f"diffusers could not load the {workflow} components of {folder}: "
                                  f"{type(exc).__name__}: {exc}") from exc
    trim_conditioner(pipe)
    log.info("loaded %s (%s) from %s (%s)", type(pipe).__name__, workflow, folder, str(dtype).removeprefix("torch."))
    return pipe


def _check_sources(pipe: ModularPipeline, folder: Path, given: dict[str, Any]) -> None:
    """Each component of the workflow not ``given`` (a file, a shipped tokenizer) has its folder,
    checked; one with none (a folder the pack carries holds configs only) is refused naming the
    file input to pick."""
    absent = []
    for name, spec in pipe._component_specs.items():
        source = getattr(spec, "pretrained_model_name_or_path", None)
        if given.get(name) is not None or spec.default_creation_method != "from_pretrained":
            continue
        if source and Path(source).is_dir():
            check_component(Path(source) / (spec.subfolder or ""), name, getattr(spec.type_hint, "__name__", "?"))
        elif source is None and name in FILE_INPUTS:
            absent.append(FILE_INPUTS[name])
    if absent:
        raise PipelineFolderError(f"{folder.name} holds configs only (no weights): pick {', '.join(absent)} "
                                  "(ComfyUI's MiniMax-H3 files, from models/diffusion_models, text_encoders and vae)")


def _require_h3(pipe: ModularPipeline, folder: Path, component: str, what: str) -> None:
    """Component files of the modular loader are MiniMax-H3's (the pipeline names the layer it reads)."""
    if not isinstance(getattr(pipe, "text_encoder_layer", None), int) or component not in pipe._component_specs:
        raise PipelineFolderError(f"{folder} is not a MiniMax-H3 pipeline: a {component}_file loads H3's {what} "
                                  "only; leave it at 'none'")


def _conditioner(pipe: ModularPipeline, folder: Path, file: Path, dtype: torch.dtype) -> Any:
    _require_h3(pipe, folder, "text_encoder", "conditioner")
    return load_conditioner_file(file, folder / "text_encoder", dtype, pipe.text_encoder_layer)


def map_weights(pipe: Any) -> Any:
    """Each component's weights whose bytes are its safetensors files' rest on a private mapping
    of the files (`formats/mapped.py`): the page cache is their store, not a RAM copy."""
    for name, module in iter_modules(pipe):
        try:
            report = map_from_files(module)
        except MappedFileError as exc:
            raise PipelineFolderError(f"{name}: {exc}") from exc
        log.info("%s: %s", name, report.line())
    return pipe


def modular_options() -> list[str]:
    """The modular configs the pack carries (MiniMax-H3's), then the modular folders under models/diffusers."""
    return [*(PACK + p.name for p in carried.carried_modular()), *list_modular_models()]


def _handle(pipe: Any, folder: Path, dtype: torch.dtype, config: OffloadConfig) -> io.NodeOutput:
    patcher = host.manage(pipe, dtype, config)
    return io.NodeOutput(PipeHandle(pipe=pipe, config=config, path=str(folder), family=family_of(pipe),
                                    dtype=dtype, patcher=patcher))


def _dtype_input() -> io.Input:
    return io.Combo.Input("dtype", options=list(DTYPES), default="auto",
                          tooltip="Weight dtype; auto picks what ComfyUI would for the device. fp8_e4m3fn / "
                                  "fp8_e5m2 store the denoisers' weights in fp8 (half the bytes to hold and "
                                  "move) and compute in the auto dtype, as ComfyUI's weight_dtype does; "
                                  "fp8_e4m3fn_fast also computes through fp8 matmuls (faster on GPUs with fp8 "
                                  "tensor cores, inputs rounded to fp8).")


def _dtypes(dtype: str, config: OffloadConfig) -> tuple[torch.dtype, torch.dtype | None, bool]:
    """(the dtype components load and compute in, the fp8 storage of the denoisers or None,
    whether they compute through fp8 matmuls)."""
    chosen = DTYPES[dtype]
    if chosen in FP8_DTYPES.values():
        return host.auto_dtype(config), chosen, dtype == FAST and host.fp8_matmul(config)
    return chosen or host.auto_dtype(config), None, False


def _store(pipe: Any, storage: torch.dtype | None, compute: torch.dtype, matmul: bool) -> Any:
    if storage is not None:
        names = [n for n, m in denoisers(pipe).items() if store_fp8(m, storage, compute, matmul) is not None]
        log.info("%s stored in %s, computing in %s%s", ", ".join(names) or "no denoiser",
                 str(storage).removeprefix("torch."), str(compute).removeprefix("torch."),
                 " through fp8 matmuls" if matmul else "")
    return pipe


class LoadPipeline(io.ComfyNode):
    """Load a diffusers pipeline folder from models/diffusers into a DIFFUSERS_PIPE."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadLoadPipeline",
            **search_aliases("offload", "block swap", "wan", "flux"),
            display_name="Load diffusers pipeline",
            category=CATEGORY,
            description="Loads a diffusers pipeline folder (model_index.json) from models/diffusers. "
                        "Weights stay in system memory until a run places them on the device.",
            inputs=[
                io.Combo.Input("model", options=list_models(),
                               tooltip="A folder under models/diffusers (or an extra_model_paths location) "
                                       "that holds model_index.json."),
                _dtype_input(),
                OffloadConfigType.Input("offload", optional=True,
                                        tooltip="Offload settings; changing them here reloads the model, "
                                                "Apply offload settings changes them without a reload."),
            ],
            outputs=[DiffusersPipe.Output(display_name="pipe")],
        )

    @classmethod
    def execute(cls, model: str, dtype: str, offload: OffloadConfig | None = None) -> io.NodeOutput:
        config = offload or OffloadConfig()
        folder = resolve_model(model)
        torch_dtype, storage, matmul = _dtypes(dtype, config)
        pipe = map_weights(_store(load_pipeline(folder, torch_dtype), storage, torch_dtype, matmul))
        return _handle(pipe, folder, torch_dtype, config)


class LoadModularPipeline(io.ComfyNode):
    """Load a modular diffusers pipeline (modular_model_index.json) for one workflow."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadLoadModularPipeline",
            **search_aliases("offload", "block swap", "h3"),
            display_name="Load modular pipeline (diffusers)",
            category=CATEGORY,
            description="Loads MiniMax-H3 from the configs the pack carries and ComfyUI's H3 files, or a modular "
                        "diffusers pipeline folder (modular_model_index.json) from models/diffusers, with only the "
                        "components the chosen workflow uses.",
            inputs=[
                io.Combo.Input("model", options=modular_options(),
                               tooltip="pack: MiniMax-H3 is the configs the pack carries (no download): pick "
                                       "ComfyUI's H3 files below (transformer, text encoder, video and audio VAE); "
                                       "its tokenizer is ComfyUI's own. Else a folder under models/diffusers "
                                       "holding modular_model_index.json."),
                io.Combo.Input("workflow", options=list(WORKFLOWS), default="t2va",
                               tooltip="t2va: text to video+audio; fl2va: also first and/or last frame; "
                                       "ref2va: references; its transformer is the folder's transformer_ref, or "
                                       "the ref2va transformer file (minimax_h3_ref2va_*)."),
                _dtype_input(),
                OffloadConfigType.Input("offload", optional=True, tooltip="Offload settings."),
                io.Combo.Input("transformer_file", options=[NONE, *denoiser_files()], default=NONE, optional=True,
                               tooltip="A transformer file from models/diffusion_models (ComfyUI's bf16, fp8, "
                                       "fp8_scaled, W4A8, W4A4, NVFP4, MXFP8 or GGUF files of the model); 'none' uses the folder's. "
                                       "The folder then needs only the transformer's config."),
                io.Combo.Input("text_encoder_file", options=[NONE, *folder_paths.get_filename_list("text_encoders")],
                               default=NONE, optional=True,
                               tooltip="MiniMax-H3's text encoder from models/text_encoders (ComfyUI's file, bf16, "
                                       "fp8_scaled or W4A8); 'none' uses the folder's. The folder then needs only "
                                       "the text encoder's config."),
                io.Combo.Input("vae_file", options=[NONE, *folder_paths.get_filename_list("vae")], default=NONE,
                               optional=True,
                               tooltip="MiniMax-H3's video VAE from models/vae (ComfyUI's bf16 file); 'none' uses "
                                       "the folder's. The folder then needs only the VAE's config."),
                io.Combo.Input("audio_vae_file", options=[NONE, *folder_paths.get_filename_list("vae")],
                               default=NONE, optional=True,
                               tooltip="MiniMax-H3's audio VAE from models/vae (ComfyUI's "
                                       "minimax_h3_audio_vae_fp32); 'none' uses the folder's."),
            ],
            outputs=[DiffusersPipe.Output(display_name="pipe")],
        )

    @classmethod
    def execute(cls, model: str, workflow: str, dtype: str, offload: OffloadConfig | None = None,
                transformer_file: str = NONE, text_encoder_file: str = NONE, vae_file: str = NONE,
                audio_vae_file: str = NONE) -> io.NodeOutput:
        config = offload or OffloadConfig()
        folder = carried.by_name(model.removeprefix(PACK)) if model.startswith(PACK) else resolve_model(model)
        torch_dtype, storage, matmul = _dtypes(dtype, config)
        file = optional(DENOISER_FOLDERS, transformer_file)
        text, vae, audio = (optional(folders, name) for folders, name in (
            (("text_encoders",), text_encoder_file), (("vae",), vae_file), (("vae",), audio_vae_file)))
        pipe = load_modular(folder, workflow, torch_dtype, *(Path(f) if f else None for f in (file, text, vae, audio)),
                            comfy_tokenizers=comfy_package())
        pipe = map_weights(_store(pipe, storage, torch_dtype, matmul))
        return _handle(pipe, folder, torch_dtype, config)


NODES: list[type[io.ComfyNode]] = [LoadPipeline, LoadModularPipeline]

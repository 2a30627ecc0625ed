"""Load diffusion model file (diffusers): a ComfyUI single-file denoiser (bf16, fp8, fp8_scaled,
int8_tensorwise, W4A8, W4A4, NVFP4, MXFP8, GGUF) in the pipeline of a config folder of the same family (Wan 2.2 A14B:
its two experts' files).

Why: small-card users keep fp8/GGUF single files in ComfyUI's model folders, not bf16 diffusers
folders. Files are listed through ``folder_paths`` (so ``extra_model_paths.yaml`` works); the
config folder gives the pipeline class, configs, tokenizer and scheduler, and the optional
text-encoder / VAE files its other weights (an all-in-one LTX-2 checkpoint: its own). For Wan,
FLUX.1, LTX-2 and Z-Image Turbo the pack carries the configs (`carried`: no diffusers folder needed;
Wan's and LTX-2's tokenizers read from the text-encoder file, FLUX.1's and Z-Image's from ComfyUI's
own tokenizer folders);
for other families a diffusers folder (a configs-only copy is enough) under models/diffusers.
"""

from __future__ import annotations

from pathlib import Path

import folder_paths
import torch
from comfy_api.latest import io

from ..offload_core import OffloadConfig
from ..offload_core.formats import carried
from ..offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from . import host
from .folders import list_models, resolve_model
from .loaders import _handle, _store
from .model_files import (
    DENOISER_FOLDERS,
    NONE,
    PACK,
    TEXT_ENCODER_FOLDERS,
    comfy_package,
    denoiser_files,
    full_path,
    optional,
    text_encoder_files,
)
from .types import CATEGORY, DiffusersPipe, OffloadConfigType
from .web_api import search_aliases

COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = ("auto", *COMPUTE)
AUTO = "auto: the configs the pack carries"
LEGACY_AUTO = ("auto: the pack's configs (Wan, FLUX.1)",)  # the option's earlier label, in saved workflows


def config_options() -> list[str]:
    """The pack's configs (picked by the file, or by name), then the diffusers folders under models/diffusers."""
    return [AUTO, *(PACK + p.name for p in carried.carried()), *list_models()]


def config_folder(config: str, denoiser: str, two_experts: bool) -> Path:
    if config == AUTO or config in LEGACY_AUTO:
        return carried.pick(Path(denoiser), two_experts)
    if config.startswith(PACK):
        return carried.by_name(config.removeprefix(PACK))
    return resolve_model(config)


class LoadDiffusionModelFile(io.ComfyNode):
    """A single-file denoiser in the pipeline of a diffusers config folder."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadLoadDiffusionModelFile",
            **search_aliases("offload", "block swap", "wan", "fp8", "gguf", "single file"),
            display_name="Load diffusion model file (diffusers)",
            category=CATEGORY,
            description="Loads a denoiser file from models/diffusion_models (bf16, fp8, fp8_scaled, int8_tensorwise, W4A8, W4A4, NVFP4, MXFP8 or GGUF) into the "
                        f"pipeline of its family: for {carried.FAMILIES} the configs the pack carries "
                        "(auto), else a "
                        "diffusers folder of the same family (configs-only is enough when the text-encoder and "
                        "VAE files are picked). The file's storage (fp8, int8, W4A8, W4A4, NVFP4, MXFP8, GGUF) is kept. "
                        "Wan 2.2 A14B: the high-noise file in denoiser, the low-noise one in denoiser_2.",
            inputs=[
                io.Combo.Input("config", options=config_options(),
                               tooltip=f"auto: the configs the pack carries for {carried.FAMILIES}, picked "
                                       "by the denoiser file's shape, then by its name where models share a shape "
                                       "(LTX-2 dev or distilled, FLUX.2 [klein] base, FLUX.1 Kontext, Qwen-Image's Edit models); "
                                       "Wan's, LTX-2's and FLUX.2 [dev]'s tokenizers are read from the text-encoder file, "
                                       "the others' are ComfyUI's own; or one of them by name; or a "
                                       "diffusers folder of the file's family under models/diffusers (configs, "
                                       "tokenizer and scheduler; weights optional)."),
                io.Combo.Input("denoiser", options=denoiser_files(),
                               tooltip="The denoiser file, from models/diffusion_models (or unet, unet_gguf), or an "
                                       "all-in-one checkpoint from models/checkpoints (LTX-2's: its connectors, VAEs "
                                       "and vocoder are read from it too)."),
                io.Combo.Input("text_encoder", options=[NONE, *text_encoder_files()],
                               default=NONE, tooltip="A text-encoder file from models/text_encoders (safetensors, "
                                                     "or a T5/UMT5 GGUF); 'none' uses the config folder's."),
                io.Combo.Input("vae", options=[NONE, *folder_paths.get_filename_list("vae")], default=NONE,
                               tooltip="A VAE file from models/vae; 'none' uses the config folder's."),
                io.Combo.Input("dtype", options=list(DTYPES), default="auto",
                               tooltip="Compute dtype; the denoiser's storage stays the file's (fp8, GGUF)."),
                OffloadConfigType.Input("offload", optional=True, tooltip="Offload settings."),
                io.Combo.Input("text_encoder_2", options=[NONE, *text_encoder_files()],
                               default=NONE, optional=True,
                               tooltip="Flux's second text encoder (T5-XXL, e.g. t5xxl_fp8_e4m3fn.safetensors; "
                                       "CLIP-L goes in text_encoder); 'none' uses the config folder's."),
                io.Boolean.Input("fp8_matmul", default=False, optional=True,
                                 tooltip="Compute the denoiser through fp8 matmuls, as ComfyUI's fp8_e4m3fn_fast "
                                         "(GPUs with fp8 tensor cores; inputs rounded to fp8): an fp8_e4m3fn file "
                                         "keeps its weights, a bf16/fp16 file is stored in fp8_e4m3fn first; "
                                         "GGUF and other quantized files are left as they are."),
                io.Combo.Input("denoiser_2", options=[NONE, *denoiser_files()], default=NONE, optional=True,
                               tooltip="Wan 2.2 A14B's low-noise expert (transformer_2), e.g. a *low_noise* file; "
                                       "the high-noise file goes in denoiser. 'none' uses the config folder's."),
                io.Combo.Input("image_encoder", options=[NONE, *folder_paths.get_filename_list("clip_vision")],
                               default=NONE, optional=True,
                               tooltip="Wan 2.1 image-to-video's CLIP vision encoder from models/clip_vision "
                                       "(clip_vision_h.safetensors); 'none' uses the config folder's."),
            ],
            outputs=[DiffusersPipe.Output(display_name="pipe")],
        )

    @classmethod
    def validate_inputs(cls, config: str) -> bool | str:
        """``config`` as the combo checks it, and the auto option under its earlier label too (a
        workflow saved with it still runs)."""
        if config in LEGACY_AUTO or config in config_options():
            return True
        return (f"config {config!r} is not auto, a config folder the pack carries or a diffusers folder under "
                "models/diffusers: pick one from the list")

    @classmethod
    def execute(cls, config: str, denoiser: str, text_encoder: str, vae: str, dtype: str,
                offload: OffloadConfig | None = None, text_encoder_2: str = NONE,
                fp8_matmul: bool = False, denoiser_2: str = NONE, image_encoder: str = NONE) -> io.NodeOutput:
        settings = offload or OffloadConfig()
        denoiser_file = full_path(DENOISER_FOLDERS, denoiser)
        folder = config_folder(config, denoiser_file, denoiser_2 != NONE)
        compute = host.auto_dtype(settings) if dtype == "auto" else COMPUTE[dtype]
        pipe = load_pipeline_with_denoiser(folder, denoiser_file, compute,
                                           optional(TEXT_ENCODER_FOLDERS, text_encoder), optional(("vae",), vae),
                                           optional(TEXT_ENCODER_FOLDERS, text_encoder_2),
                                           optional(DENOISER_FOLDERS, denoiser_2),
                                           optional(("clip_vision",), image_encoder),
                                           comfy_tokenizers=comfy_package())
        if fp8_matmul and host.fp8_matmul(settings):
            _store(pipe, torch.float8_e4m3fn, compute, matmul=True)
        return _handle(pipe, folder, compute, settings)


NODES: list[type[io.ComfyNode]] = [LoadDiffusionModelFile]

"""A ComfyUI all-in-one checkpoint: the denoiser under ``model.diffusion_model.`` and, beside it,
the other models of its pipeline (LTX-2's ``ltx-2-19b-*.safetensors``: text connectors, video VAE,
audio VAE, vocoder), each loaded from the same file into the class and config of its component.

Why our own: diffusers 0.42.1 converts LTX-2's transformer and video VAE from single files, has a
converter function but no loader for its audio VAE, and nothing for the connectors or the vocoder:
their renames below are diffusers' own conversion script's (``scripts/convert_ltx2_to_diffusers.py``,
LTX-2.0's tables), applied in the same order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights

from ..log import get_logger
from .decoded import decoded_weight
from .fp8 import INPUT_KEY, INT8, SCALE_KEY, dequantize, is_fp8, popped
from .inspect import SingleFileError, SingleFileInfo
from .quant_entries import PACKED_QUANT, convrot_groups, read_quant_layers
from .state_fit import keeps_fp32, mismatch_text

log = get_logger("single_file")

DENOISER = "model.diffusion_model."
CONNECTORS = (f"{DENOISER}video_embeddings_connector.", f"{DENOISER}audio_embeddings_connector.",
              "text_embedding_projection.")
PARTS: dict[str, dict[str, tuple[str, ...]]] = {  # family -> component -> its keys' prefixes in the file
    "ltx2": {"connectors": CONNECTORS, "vae": ("vae.",), "audio_vae": ("audio_vae.",), "vocoder": ("vocoder.",)},
}
RENAMES: dict[str, tuple[tuple[str, str], ...]] = {  # the conversion script's LTX-2.0 tables, in its order
    "vocoder": (("vocoder.", ""), ("ups", "upsamplers"), ("resblocks", "resnets"), ("conv_pre", "conv_in"),
                ("conv_post", "conv_out")),
    "connectors": ((DENOISER, ""), ("connectors.", ""), ("video_embeddings_connector", "video_connector"),
                   ("audio_embeddings_connector", "audio_connector"), ("transformer_1d_blocks", "transformer_blocks"),
                   ("text_embedding_projection.aggregate_embed", "text_proj_in"), ("q_norm", "norm_q"),
                   ("k_norm", "norm_k")),
}


def parts_in(info: SingleFileInfo) -> list[str]:
    """The components besides the denoiser that the checkpoint ``info`` describes holds."""
    return [name for name, prefixes in PARTS.get(info.family or "", {}).items()
            if any(k.startswith(prefixes) for k in info.shapes)]


def denoiser_only(checkpoint: dict[str, torch.Tensor], info: SingleFileInfo) -> dict[str, torch.Tensor]:
    """The denoiser's tensors of ``checkpoint``: of a checkpoint (keys under ``model.diffusion_model.``
    beside others: Comfy-Org's all-in-one FLUX.1 files hold its VAE and text encoders too) those
    under that prefix, less the other components' (LTX-2's connectors); any other file as it is."""
    if not any(k.startswith(DENOISER) for k in checkpoint):
        return checkpoint
    others = tuple(p for name in parts_in(info) for p in PARTS[info.family][name])
    return {k: v for k, v in checkpoint.items() if k.startswith(DENOISER) and not k.startswith(others or ("\0",))}


def load_part(name: str, checkpoint: dict[str, torch.Tensor], info: SingleFileInfo, folder: Path,
              cls: type, dtype: torch.dtype) -> Any:
    """Component ``name`` (class ``cls``, config ``folder/name``) from the checkpoint's tensors."""
    prefixes = PARTS[info.family][name]
    packed = {k: c["format"] for k, c in read_quant_layers(info).items()
              if k.startswith(prefixes) and isinstance(c, dict) and c.get("format") in PACKED_QUANT}
    if packed:
        raise SingleFileError(f"{info.path}: {'/'.join(sorted(set(packed.values())))} layers in its {name} "
                              f"({', '.join(sorted(packed)[:3])}): the pack keeps those formats in denoisers and text "
                              "encoders only; use the fp8 or bf16 checkpoint of the model")
    state = _decoded({k: v for k, v in checkpoint.items() if k.startswith(prefixes)}, info, dtype)
    if name == "vae":
        return _from_single_file(cls, state, folder, name, dtype, info.path)
    if name == "audio_vae":
        from diffusers.loaders.single_file_utils import convert_ltx2_audio_vae_to_diffusers

        state = convert_ltx2_audio_vae_to_diffusers(state)
    else:
        state = {_renamed(k, RENAMES[name]): v for k, v in state.items()}
    return _assigned(cls, state, folder / name, dtype, info.path)


def _decoded(state: dict[str, torch.Tensor], info: SingleFileInfo, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A part's fp8 and int8 weights decoded to ``dtype`` with their scales (``<layer>.scale_weight``,
    the spelling `single_file.read_checkpoint` gives them; int8 convrot rotated back): these parts
    run once a prompt or a decode, so they keep no quantized storage."""
    scales = popped(state, SCALE_KEY)
    popped(state, INPUT_KEY)
    groups = convrot_groups(info)
    for key, value in list(state.items()):
        layer = key.rsplit(".", 1)[0]
        if layer in scales and (is_fp8(value) or value.dtype == INT8):
            state[key] = decoded_weight(info.path, layer, value, scales[layer], dtype, groups.get(layer, 0))
        elif is_fp8(value):
            state[key] = dequantize(value, None, dtype)
        elif value.dtype == INT8:
            raise SingleFileError(f"{info.path}: {key} is stored in int8 without a weight scale; the file is "
                                  "incomplete, download it again")
    return state


def _renamed(key: str, table: tuple[tuple[str, str], ...]) -> str:
    for old, new in table:
        key = key.replace(old, new)
    return key


def _from_single_file(cls: type, state: dict[str, torch.Tensor], folder: Path, name: str, dtype: torch.dtype,
                      path: Path) -> Any:
    try:
        return cls.from_single_file(state, config=str(folder), subfolder=name, torch_dtype=dtype, local_files_only=True)
    except Exception as exc:  # diffusers' errors name neither the file nor the folder
        raise SingleFileError(f"diffusers could not load the {name} of {path} as {cls.__name__} with the config of "
                              f"{folder / name}: {type(exc).__name__}: {exc}") from exc


def _assigned(cls: type, state: dict[str, torch.Tensor], config: Path, dtype: torch.dtype, path: Path) -> Any:
    """An empty ``cls`` of ``config`` holding ``state`` exactly, in ``dtype`` but for the modules
    diffusers keeps in float32; a checkpoint part that does not fill it is refused by name."""
    with init_empty_weights():
        model = cls.from_config(cls.load_config(str(config)))
    problem = mismatch_text(model.state_dict(), state)
    if problem:
        raise SingleFileError(f"{path}: its {config.name} does not fit {cls.__name__} of {config}: {problem}")
    model.load_state_dict({k: v.to(torch.float32 if keeps_fp32(cls, k) else dtype) if v.is_floating_point() else v
                           for k, v in state.items()}, strict=True, assign=True)
    log.info("%s: %s read from the checkpoint", Path(path).name, config.name)
    return model.eval()

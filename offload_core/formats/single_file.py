"""Load a ComfyUI single-file denoiser (bf16, fp8, fp8_scaled, ComfyUI per-tensor fp8,
int8_tensorwise, W4A8, ConvRot W4A4, NVFP4 and MXFP8, GGUF) into the diffusers class of a config folder of the same family.

Keys are converted by diffusers' own single-file conversion (the mapping function
`from_single_file` uses). GGUF files go through `from_single_file` itself (its GGUF quantizer).
safetensors files do not: diffusers 0.42.1 casts fp8 values to the compute dtype and drops every
``scale_weight`` (silently wrong weights, twice the bytes), and casts every module, its fp32
ones included, to the compute dtype (unlike its folder loader). Here the converted tensors are
assigned into an empty model: fp8 and int8 ones as they are (`fp8.mark_fp8` records their
scales), W4A8, ConvRot W4A4, NVFP4 and MXFP8 layers as `stored_linear.StoredLinear` layers over their stored tensors, the rest in the
compute dtype except diffusers' ``_keep_in_fp32_modules``, as `from_pretrained` keeps them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import diffusers
import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file

from ..log import get_logger
from .checkpoint_parts import denoiser_only
from .fp8 import (
    INPUT_KEY,
    INT8,
    SCALE_KEY,
    check_int8_scale,
    decode_int8,
    dequantize,
    is_fp8,
    mark_fp8,
    popped,
    scale_value,
)
from .inspect import (
    INPUT_SCALE_SUFFIXES,
    QUANT_SUFFIX,
    VARIANT_FLAGS,
    SingleFileError,
    SingleFileInfo,
    inspect_file,
    inspect_safetensors,
)
from .quant_entries import check_quant_layers, convrot_groups, stored_kinds
from .scale_trace import follow_rows, trace_rows
from .state_fit import keeps_fp32, mismatch
from .stored_linear import StoredKind, swap_stored

log = get_logger("single_file")

CLASS_FAMILIES: tuple[tuple[str, str], ...] = (  # diffusers class-name prefix -> family (first match)
    ("WanVACE", "wan"), ("WanAnimate", "wan"), ("Wan", "wan"), ("Flux2", "flux2"), ("Flux3", "flux3"),
    ("Flux", "flux"), ("Chroma", "chroma"), ("LTX2", "ltx2"), ("LTXVideo", "ltx-video"), ("MiniMaxH3", "minimax_h3"),
    ("HunyuanVideo", "hunyuan-video"), ("Mochi", "mochi"), ("SD3", "sd3"), ("AuraFlow", "auraflow"),
    ("Lumina2", "lumina2"), ("Sana", "sana"), ("HiDream", "hidream"), ("Cosmos", "cosmos"), ("ZImage", "z-image"),
    ("QwenImage21", "qwen-image-2"), ("QwenImage", "qwen-image"), ("Krea2", "krea2"),
)


def class_family(class_name: str) -> str | None:
    return next((family for prefix, family in CLASS_FAMILIES if class_name.startswith(prefix)), None)


def model_class(folder: Path, what: str) -> type:
    """The diffusers class a component folder's ``config.json`` names."""
    config = Path(folder) / "config.json"
    try:
        name = json.loads(config.read_text(encoding="utf-8"))["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SingleFileError(f"{config} cannot be read ({exc}): the config folder needs the {what} config "
                              "(config.json with _class_name); use a diffusers folder of the model's family") from exc
    cls = getattr(diffusers, str(name), None)
    if not isinstance(cls, type):
        raise SingleFileError(f"{config} names {name!r}, which this diffusers version does not have")
    return cls


def load_denoiser(path: Path, config_folder: Path, compute: torch.dtype, subfolder: str = "transformer") -> Any:
    """The denoiser of single file ``path`` as the class of ``config_folder/subfolder``, computing in
    ``compute``; fp8 and int8 files keep their storage (with their scales), GGUF files their packed bytes."""
    path, config_folder = Path(path), Path(config_folder)
    if not path.is_file():
        raise SingleFileError(f"{path} does not exist: pick a file from models/diffusion_models")
    cls = model_class(config_folder / subfolder, subfolder)
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, config_folder, subfolder, cls, compute)
    info = inspect_safetensors(path)
    _check_denoiser(info, cls, config_folder)
    check_quant_layers(info)  # (a file without comfy_quant entries is read for stray int8 weights only)
    return _load_converted(path, info, config_folder, subfolder, cls, compute)


def _check_denoiser(info: SingleFileInfo, cls: type, config_folder: Path) -> None:
    """A text encoder, VAE, LoRA or a denoiser of another family is refused, saying what it is."""
    if info.role != "denoiser":
        hint = {"text_encoder": "pick it as the text-encoder file", "vae": "pick it as the VAE file",
                "lora": "load it with Load LoRA (diffusers)"}.get(info.role, "pick a denoiser file")
        raise SingleFileError(f"{info.path} looks like {info.looks_like}, not a denoiser: {hint}")
    expected = class_family(cls.__name__)
    if info.family != expected:
        raise SingleFileError(
            f"{info.path} is {info.looks_like}, but the config folder {config_folder} is a {expected or cls.__name__} "
            f"model ({cls.__name__}): pick a config folder of the file's family, or a {expected} file")


def from_single_file(path: Path, config_folder: Path, subfolder: str, cls: type, **kwargs: Any) -> Any:
    try:
        return cls.from_single_file(str(path), config=str(config_folder), subfolder=subfolder,
                                    local_files_only=True, **kwargs)
    except Exception as exc:  # diffusers' errors name neither the file nor the folder
        raise SingleFileError(f"diffusers could not load {path} as {cls.__name__} with the config of "
                              f"{config_folder / subfolder}: {type(exc).__name__}: {exc}") from exc


def _load_gguf(path: Path, config_folder: Path, subfolder: str, cls: type, compute: torch.dtype) -> Any:
    from diffusers import GGUFQuantizationConfig

    _check_gguf(path, cls, config_folder)
    model = from_single_file(path, config_folder, subfolder, cls, torch_dtype=compute,
                              quantization_config=GGUFQuantizationConfig(compute_dtype=compute))
    log.info("%s: GGUF denoiser loaded as %s (packed weights, dequantised to %s at compute)", path.name,
             cls.__name__, short_dtype(compute))
    return model


def _check_gguf(path: Path, cls: type, config_folder: Path) -> None:
    """The GGUF header reader refuses bad files and unknown types by name; the key names, a text
    encoder, VAE or a denoiser of another family, as for a safetensors file."""
    _check_denoiser(inspect_file(path), cls, config_folder)


def _load_converted(path: Path, info: SingleFileInfo, config_folder: Path, subfolder: str, cls: type,
                    compute: torch.dtype) -> Any:
    """The file's tensors, keys converted by diffusers, assigned into an empty model; fp8 weights
    kept as they are and marked with their scales."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    mapping = SINGLE_FILE_LOADABLE_CLASSES.get(cls.__name__)
    if mapping is None:
        raise SingleFileError(f"{path}: diffusers has no single-file conversion for {cls.__name__}")
    checkpoint = denoiser_only(read_checkpoint(path, info), info)
    kinds = stored_kinds(info)
    held = [(kind, kind.pop(path, checkpoint)) for kind in kinds]  # (before the fp8 and int8 scales: some share
    # their spelling; taken out so that the conversion sees weights only)
    file_scales, file_inputs = (popped(checkpoint, key) for key in (SCALE_KEY, INPUT_KEY))  # traced, not converted
    config = cls.load_config(str(config_folder), subfolder=subfolder, local_files_only=True)
    with init_empty_weights():
        model = cls.from_config(config)
    expected = model.state_dict()
    shapes = {k: tuple(t.shape) for k, t in checkpoint.items()}
    convert = mapping["checkpoint_mapping_fn"]
    try:
        converted = checkpoint if set(expected) <= set(checkpoint) else convert(config=config, checkpoint=checkpoint)
    except Exception as exc:  # diffusers' own conversion error, named with the file
        raise SingleFileError(f"{path}: diffusers' {cls.__name__} conversion failed on it "
                              f"({type(exc).__name__}: {exc}); is it a complete {cls.__name__} file?") from exc
    file_groups = {layer: g for layer, g in convrot_groups(info).items() if f"{layer}.weight" in shapes}
    quantized = sorted({*(layer for _kind, extras in held for layer in extras), *file_scales, *file_inputs,
                        *file_groups})
    traced = ({layer: (layer, slice(None)) for layer in quantized} if converted is checkpoint  # one probe for all
              else trace_rows(path, cls, convert, config, shapes, quantized, "quantized layers"))
    for kind, extras in held:
        kind.attach(converted, extras, {k: v for k, v in traced.items() if v[0] in extras})
    scales, inputs = (follow_rows(traced, values, shapes) for values in (file_scales, file_inputs))
    groups = {key: file_groups[layer] for key, (layer, _rows) in traced.items() if layer in file_groups}
    as_stored = _swap_stored(path, kinds, model, converted, cls, compute)
    _check_keys(path, converted, model.state_dict(), cls, config_folder / subfolder)
    state = _compute_state(converted, scales, cls, compute, as_stored, groups)
    params = dict(model.named_parameters())
    for key in [k for k, t in state.items() if t.dtype == INT8 and k in params]:  # no gradient on integers
        params[key].requires_grad_(False)
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    if not scales and not any(is_fp8(t) or t.dtype == INT8 for k, t in state.items() if k not in as_stored):
        log.info("%s: %s denoiser in %s loaded as %s, computing in %s", path.name, info.family, info.format,
                 cls.__name__, short_dtype(compute))
        return model
    try:
        table = mark_fp8(model, compute, scales, source=str(path), input_scales=inputs, matmul_off=_matmul_off(info),
                         convrot=groups)
    except ValueError as exc:
        raise SingleFileError(str(exc)) from exc
    kind, storage = ("int8_tensorwise", "int8") if table.int8 else ("per-tensor", "fp8")
    log.info("%s: %s denoiser in %s (%d %s scales, %d input scales for fp8 matmuls) loaded as %s, %s storage kept",
             path.name, info.family, info.format, len(scales), kind, len(table.inputs), cls.__name__, storage)
    return model


def _matmul_off(info: SingleFileInfo) -> str:
    """Why the file keeps fp8 matmuls off: a two-element ``scaled_fp8`` marker asks for
    full-precision matmuls (ComfyUI's ``full_precision_matrix_mult``)."""
    two = info.marker is not None and info.shapes.get(info.marker) == (2,)
    return "its scaled_fp8 marker asks for full-precision matmuls" if two else ""


def read_checkpoint(path: Path, info: SingleFileInfo) -> dict[str, torch.Tensor]:
    """The file's tensors less the marker, ComfyUI's variant flags, quant entries and a tokenizer it carries (not a weight:
    `carried.missing_tokenizers` reads it where the config folder has no tokenizer); weight and
    input scales under one spelling each (``<layer>.scale_weight``, ``<layer>.scale_input``), taken
    out by layer for a denoiser (`scale_trace` follows them through its conversion) and renamed with
    their layers by a text encoder's layout. A legacy ``scale_input`` of 1 is dropped, as ComfyUI drops it
    (that layer's fp8 matmuls scale each input by its own largest value)."""
    try:
        checkpoint = load_file(str(path))
    except Exception as exc:
        raise SingleFileError(f"{path} cannot be read by safetensors ({exc}): download this file again") from exc
    if info.marker:
        checkpoint.pop(info.marker, None)
    for key in [k for k in checkpoint if k.rsplit(".", 1)[-1] in VARIANT_FLAGS]:
        checkpoint.pop(key)
        log.info("%s: ComfyUI's variant flag %s is left aside: not a weight (the config says the variant)", path.name, key)
    for key in info.tokenizers:
        checkpoint.pop(key, None)
        log.info("%s: its own tokenizer (%s) is left aside: not a weight of the model", path.name, key)
    for key in [k for k in checkpoint if k.endswith(INPUT_SCALE_SUFFIXES)]:
        value = checkpoint.pop(key)
        if not (key.endswith(INPUT_KEY) and value.numel() == 1 and float(value) == 1.0):
            checkpoint[key.rsplit(".", 1)[0] + INPUT_KEY] = value
    for key in [k for k in checkpoint if k.endswith(QUANT_SUFFIX)]:
        checkpoint.pop(key)
    for layer, key in info.scales.items():
        checkpoint[layer + SCALE_KEY] = checkpoint.pop(key)
    return checkpoint


def _check_keys(path: Path, converted: dict, expected: dict, cls: type, config: Path) -> None:
    missing, unexpected, wrong = mismatch(expected, converted)
    if missing or unexpected or wrong:
        raise SingleFileError(
            f"{path} does not match the {cls.__name__} config in {config}: "
            f"{len(missing)} weights missing {missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}, "
            f"{len(wrong)} of another shape {wrong[:3]}: pick the config folder of this model size and variant")


def _compute_state(converted: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], cls: type,
                   compute: torch.dtype, as_stored: set[str], groups: dict[str, int]) -> dict[str, torch.Tensor]:
    """Non-fp8 floats in the compute dtype; diffusers' fp32 modules (half compute) in fp32, an fp8
    or int8 weight among them dequantised as ComfyUI does (to the compute dtype, then held in fp32;
    a convrot one rotated back, its entry taken from ``groups``); fp8 and int8 tensors otherwise as
    stored, and so are the keys ``as_stored`` (stored layers')."""
    state = {}
    for key, t in converted.items():
        fp32 = _fp32(cls, key, compute)
        if key in as_stored:
            pass
        elif t.dtype == INT8 and fp32 and key.endswith(".weight"):
            layer = key.removesuffix(".weight")
            try:
                scale = check_int8_scale(scales.pop(layer, None), layer, t, cls.__name__)
            except ValueError as exc:
                raise SingleFileError(str(exc)) from exc
            t = decode_int8(t, scale, compute, groups.pop(layer, 0)).float()
        elif is_fp8(t) and fp32:
            scale = scales.pop(key.removesuffix(".weight"), None)
            if scale is not None and scale.numel() != 1:
                raise SingleFileError(f"the scale of {key} has shape {tuple(scale.shape)} for a weight of shape "
                                      f"{tuple(t.shape)}; only per-tensor scales (one value) are supported")
            t = dequantize(t, None if scale is None else scale_value(scale, compute), compute).float()
        elif t.is_floating_point() and not is_fp8(t):
            t = t.to(torch.float32 if fp32 else compute)
        state[key] = t
    return state


def _fp32(cls: type, key: str, compute: torch.dtype) -> bool:
    """``key`` is in diffusers' ``_keep_in_fp32_modules`` and the compute dtype is half (else it computes as is)."""
    return compute in (torch.float16, torch.bfloat16) and keeps_fp32(cls, key)


def _swap_stored(path: Path, kinds: list[StoredKind], model: torch.nn.Module, converted: dict[str, torch.Tensor],
                 cls: type, compute: torch.dtype) -> set[str]:
    """The converted W4A8, ConvRot W4A4, NVFP4 and MXFP8 layers become stored layers of ``model`` (those in
    diffusers' fp32 modules are decoded to a float32 weight instead); returns the converted keys to
    keep as stored."""
    try:
        kept, counts = swap_stored(model, converted, kinds, compute, lambda n: _fp32(cls, n, compute))
    except ValueError as exc:
        raise SingleFileError(f"{path}: {exc}") from exc
    for name, (swapped, decoded) in counts.items():
        log.info("%s: %d %s layers kept as stored, computed through comfy-kitchen; %d decoded to float32 at load "
                 "(diffusers keeps them in fp32)", path.name, swapped, name, decoded)
    return kept


def short_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""ComfyUI's self-describing quant entries (a ``<layer>.comfy_quant`` entry per layer, or the
header's ``_quantization_metadata``): read, and checked against the tensors the header holds, so
that a format this engine cannot run, or an inconsistent file, is refused by name before loading.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from . import mxfp8, nvfp4, w4a4, w4a8
from .convrot import DEFAULT_GROUP, group_error
from .inspect import QUANT_METADATA, QUANT_SUFFIX, SingleFileError, SingleFileInfo
from .stored_linear import StoredKind
from .tiled_scales import tiled_shape

LOADABLE_QUANT = {"float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "asym_w4a8_int8", "nvfp4", "convrot_w4a4", "mxfp8"}  # per-tensor fp8 (fp8_scaled by another
# name); int8 with a per-tensor or per-row scale, convrot (Hadamard-rotated weights) or not
INT8_QUANT = "int8_tensorwise"
W4A8_FORMAT, NVFP4_FORMAT, W4A4_FORMAT = w4a8.FORMAT, nvfp4.NVFP4, w4a4.FORMAT
PACKED_QUANT = {W4A8_FORMAT, NVFP4_FORMAT, W4A4_FORMAT}  # two weights a byte: a layer's width is twice its stored weight's
STORED_QUANT = {*PACKED_QUANT, mxfp8.FORMAT}  # held by stored layers (`stored_linear`), block scales their own
ACCEPTED_QUANT = (
    "float8_e4m3fn / float8_e5m2 with per-tensor scales, int8_tensorwise with or without convrot "
    "(per-tensor or per-row scales), asym_w4a8_int8 (W4A8), convrot_w4a4, nvfp4 and mxfp8 (these four through comfy-kitchen)"
)

def read_quant_layers(info: SingleFileInfo) -> dict[str, dict]:
    """ComfyUI's self-describing quant config, layer -> {"format": ...}: the header metadata's
    ``_quantization_metadata`` and every ``<layer>.comfy_quant`` entry (uint8 JSON bytes)."""
    layers: dict[str, dict] = {}
    raw = info.metadata.get(QUANT_METADATA)
    if raw is not None:
        try:
            parsed = json.loads(raw)
            layers.update(parsed["layers"])
        except (ValueError, TypeError, KeyError) as exc:
            raise SingleFileError(
                f"{info.path}: its {QUANT_METADATA} header entry is not valid ({exc})"
            ) from exc
    if info.quant_keys:
        with safe_open(str(info.path), framework="pt") as f:
            for key in info.quant_keys:
                try:
                    layers[key.removesuffix(QUANT_SUFFIX)] = json.loads(bytes(f.get_tensor(key).tolist()))
                except (ValueError, TypeError) as exc:
                    raise SingleFileError(
                        f"{info.path}: {key} is not a valid comfy_quant entry ({exc})"
                    ) from exc
    return layers


def check_quant_layers(info: SingleFileInfo) -> None:
    """Refuse, by name, a ComfyUI quant format this engine cannot run. Per-tensor fp8 passes (it is
    fp8_scaled by another name: ``<layer>.weight_scale`` next to an fp8 weight), and so does
    ``int8_tensorwise``: an int8 weight and its ``weight_scale`` (with convrot, a matrix its group
    size can rotate); an int8 weight no ``int8_tensorwise`` entry declares is refused (its
    dequantisation would be a guess); W4A8, ConvRot W4A4, NVFP4 and MXFP8 layers hold what comfy-kitchen reads."""
    layers = read_quant_layers(info)
    formats = {str(conf.get("format")) if isinstance(conf, dict) else repr(conf) for conf in layers.values()}
    unknown = sorted(formats - LOADABLE_QUANT)
    if unknown:
        raise SingleFileError(
            f"{info.path} is a ComfyUI quantized file ({len(layers)} layers, formats {', '.join(sorted(formats))}): "
            f"this pack does not run comfy-kitchen layouts ({', '.join(unknown)}) yet; it runs {ACCEPTED_QUANT}. "
            "Use such a file, an fp8, fp8_scaled, GGUF or bf16 file of the model, or ComfyUI's own loader"
        )
    _check_convrot(info)
    full = [k for k, conf in layers.items()
            if isinstance(conf, dict) and conf.get("group_size") and conf.get("format") not in STORED_QUANT]
    if full:
        raise SingleFileError(
            f"{info.path}: layers {full[:3]} use block-wise fp8 scales; only per-tensor scales are supported"
        )
    w4a4_entries = {k: conf for k, conf in layers.items() if conf.get("format") == W4A4_FORMAT}
    _check_int8_weights(info, {k for k, conf in layers.items() if conf.get("format") == INT8_QUANT}, set(w4a4_entries))
    _check_w4a4(info, w4a4_entries)
    _check_w4a8(info, {k: conf for k, conf in layers.items() if conf.get("format") == W4A8_FORMAT})
    for fmt, kitchen in ((NVFP4_FORMAT, nvfp4.kitchen), (mxfp8.FORMAT, mxfp8.kitchen)):
        _check_tiled(info, sorted(k for k, conf in layers.items() if conf.get("format") == fmt), fmt, kitchen)


def convrot_groups(info: SingleFileInfo) -> dict[str, int]:
    """The file's convrot int8 layers (by file layer name) and their group sizes, read as ComfyUI's
    ops.py reads them: ``convrot`` and ``convrot_groupsize`` from the entry, then its ``params``."""
    groups = {}
    for layer, conf in read_quant_layers(info).items():
        params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
        if conf.get("format") == INT8_QUANT and conf.get("convrot", params.get("convrot", False)):
            groups[layer] = int(conf.get("convrot_groupsize", params.get("convrot_groupsize", DEFAULT_GROUP)))
    return groups


def _check_convrot(info: SingleFileInfo) -> None:
    """Each convrot layer's weight is a matrix its group size can rotate (a power of 4 dividing its width)."""
    for layer, group in sorted(convrot_groups(info).items()):
        shape = info.shapes.get(f"{layer}.weight", ())
        why = (f"its weight has shape {tuple(shape)}, not a matrix" if len(shape) != 2
               else group_error(group, shape[1]))
        if why is not None:
            raise SingleFileError(f"{info.path}: layer {layer} is declared int8_tensorwise with convrot, but {why}; "
                                  "the file is inconsistent, download it again")


def w4a8_conf(info: SingleFileInfo) -> w4a8.W4A8Conf:
    """The group geometry of the file's W4A8 layers (`check_quant_layers` allows one per file)."""
    return next((w4a8.W4A8Conf.of(c) for c in read_quant_layers(info).values()
                 if isinstance(c, dict) and c.get("format") == W4A8_FORMAT), w4a8.W4A8Conf())


def _check_w4a8(info: SingleFileInfo, layers: dict[str, dict]) -> None:
    """W4A8 layers need comfy-kitchen, one group geometry, and each its int8 weight and scales."""
    if not layers:
        return
    _one_conf(info, layers, w4a8.kitchen, w4a8.W4A8Conf, "W4A8 (asym_w4a8_int8)", "group geometries")
    for layer in sorted(layers):
        held = {s: info.dtypes.get(f"{layer}.{s}") for s in ("weight", "weight_s_rel", "weight_s_channel")}
        if held["weight"] != torch.int8 or None in held.values():
            missing = [s for s, d in held.items() if d is None]
            raise SingleFileError(f"{info.path}: layer {layer} is declared asym_w4a8_int8 but the file lacks "
                                  f"{', '.join(missing) or 'an int8 weight'} for it; the file is inconsistent, "
                                  "download it again")


@dataclass(frozen=True)
class _Tiled:
    """What a block-scaled format's layer holds (NVFP4, MXFP8): its weight's dtype (``label`` says it)
    and values a byte, the padding of both sides, values a block scale, and the tensors beside."""

    weight: torch.dtype
    label: str
    per_byte: int
    pad: int
    block: int
    extra: tuple[str, ...] = ()


TILED = {NVFP4_FORMAT: _Tiled(torch.uint8, "packed uint8", 2, 16, 16, ("weight_scale_2",)),
         mxfp8.FORMAT: _Tiled(torch.float8_e4m3fn, "float8_e4m3fn", 1, 32, 32)}


def _check_tiled(info: SingleFileInfo, layers: list[str], fmt: str, kitchen: Callable[[], Any]) -> None:
    """Block-scaled layers (``fmt``: `TILED`) need comfy-kitchen, and each a weight of the format's
    dtype padded on both sides, its block scales in comfy-kitchen's tiled layout for that weight, and
    the tensors the format keeps beside them."""
    if not layers:
        return
    try:
        kitchen()
    except ImportError as exc:
        raise SingleFileError(f"{info.path} is an {fmt.upper()} file: {exc}") from exc
    t = TILED[fmt]
    for layer in layers:
        shape, dtype = info.shapes.get(f"{layer}.weight"), info.dtypes.get(f"{layer}.weight")
        blocks = info.shapes.get(info.scales.get(layer, ""))
        lacking = next((name for name in t.extra if f"{layer}.{name}" not in info.shapes), None)
        why = ("no weight" if shape is None else
               f"a {str(dtype).removeprefix('torch.')} weight, not {t.label}" if dtype != t.weight or len(shape) != 2
               else f"a weight of shape {tuple(shape)}, not padded to {t.pad} x {t.pad}"
               if shape[0] % t.pad or shape[1] * t.per_byte % t.pad
               else "no weight_scale" if blocks is None
               else f"no {lacking}" if lacking
               else None)
        want = None if why else tiled_shape(shape[0], shape[1] * t.per_byte // t.block)
        if want is not None and tuple(blocks) != want:
            why = f"block scales of shape {tuple(blocks)} for a weight of shape {tuple(shape)} (expected {want})"
        if why is not None:
            raise SingleFileError(f"{info.path}: layer {layer} is declared {fmt} but the file holds {why} for it; "
                                  "the file is inconsistent, download it again")


def layers_of(info: SingleFileInfo, fmt: str) -> list[str]:
    """The file's layers of format ``fmt``, by file layer name."""
    return sorted(k for k, c in read_quant_layers(info).items() if isinstance(c, dict) and c.get("format") == fmt)


def w4a4_conf(info: SingleFileInfo) -> w4a4.W4A4Conf:
    """The rotation and linear of the file's W4A4 layers (`check_quant_layers` allows one per file)."""
    return next((w4a4.W4A4Conf.of(c) for c in read_quant_layers(info).values()
                 if isinstance(c, dict) and c.get("format") == W4A4_FORMAT), w4a4.W4A4Conf())


def stored_kinds(info: SingleFileInfo) -> list[StoredKind]:
    """The stored formats a file's layers may take, with its geometries."""
    return [w4a8.Kind(w4a8_conf(info)), w4a4.Kind(w4a4_conf(info), tuple(layers_of(info, w4a4.FORMAT))), nvfp4.Kind(),
            mxfp8.Kind(tuple(layers_of(info, mxfp8.FORMAT)))]


def _one_conf(info: SingleFileInfo, layers: dict[str, dict], kitchen: Callable[[], Any], conf: Any, name: str,
              what: str) -> Any:
    """The one ``conf`` (a conf class, read from an entry by ``of``) a format's ``layers`` share,
    its comfy-kitchen module (``kitchen``) checked present; refused by name otherwise."""
    try:
        kitchen()
    except ImportError as exc:
        raise SingleFileError(f"{info.path} is a {name} file: {exc}") from exc
    confs = {conf.of(entry) for entry in layers.values()}
    if len(confs) > 1:
        raise SingleFileError(f"{info.path}: its {name} layers use {len(confs)} {what} ({sorted(map(str, confs))}); "
                              "one per file is supported")
    return confs.pop()


def _check_w4a4(info: SingleFileInfo, layers: dict[str, dict]) -> None:
    """W4A4 layers need comfy-kitchen, one rotation and linear, and each a packed int8 matrix whose
    width the rotation and comfy-kitchen's quantization group divide, with one scale per row."""
    if not layers:
        return
    conf = _one_conf(info, layers, w4a4.kitchen, w4a4.W4A4Conf, "ConvRot W4A4 (convrot_w4a4)", "rotations or linears")
    if conf.linear_dtype not in ("int4", "int8"):
        raise SingleFileError(f"{info.path}: its W4A4 layers ask for a {conf.linear_dtype} linear; comfy-kitchen "
                              "has int4 and int8 ones")
    group = conf.convrot_groupsize
    for layer in sorted(layers):
        shape, dtype = info.shapes.get(f"{layer}.weight"), info.dtypes.get(f"{layer}.weight")
        scale = info.shapes.get(info.scales.get(layer, ""))
        why = ("no weight" if shape is None else
               f"a {str(dtype).removeprefix('torch.')} weight, not packed int8" if dtype != torch.int8 or len(shape) != 2
               else "no weight_scale" if scale is None
               else f"a weight_scale of shape {tuple(scale)} for {shape[0]} rows" if math.prod(scale) != shape[0]
               else group_error(group, shape[1] * 2) or (f"its input width {shape[1] * 2} is not a multiple of "
                                                         f"{w4a4.GROUP}" if shape[1] * 2 % w4a4.GROUP else None))
        if why is not None:
            raise SingleFileError(f"{info.path}: layer {layer} is declared convrot_w4a4 but the file holds {why} for "
                                  "it; the file is inconsistent, download it again")


def _check_int8_weights(info: SingleFileInfo, declared: set[str], w4a4_layers: set[str]) -> None:
    """Each ``int8_tensorwise`` layer has an int8 weight and a scale; each int8 weight is declared
    (``w4a4_layers``: packed W4A4 weights, checked apart)."""
    for layer in sorted(declared):
        dtype = info.dtypes.get(f"{layer}.weight")
        if dtype != torch.int8 or layer not in info.scales:
            stored = "no weight" if dtype is None else f"a {str(dtype).removeprefix('torch.')} weight"
            scale = "" if layer in info.scales else " and no weight_scale"
            raise SingleFileError(
                f"{info.path}: layer {layer} is declared int8_tensorwise but the file holds "
                f"{stored}{scale} for it; the file is inconsistent, download it again"
            )
    stray = sorted(
        k
        for k, d in info.dtypes.items()
        if d == torch.int8 and k.endswith(".weight") and k.removesuffix(".weight") not in declared | w4a4_layers
        and k.removesuffix(".weight") + ".weight_s_rel" not in info.dtypes
    )
    if stray:
        raise SingleFileError(
            f"{info.path}: {len(stray)} int8 weights ({', '.join(stray[:3])}) have no int8_tensorwise "
            "comfy_quant entry; this pack runs ComfyUI's self-describing int8 files only"
        )

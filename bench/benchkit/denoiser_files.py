"""The denoiser files single_file_node.py runs, written tensor by tensor (a 14B file costs host memory
for one tensor), from the native anchor's tensor list (``make_wan_sd.wan_tensor_specs``: Comfy-Org's key
names): ``write_fp8_scaled`` stores every Linear weight as Comfy-Org's fp8_scaled files do (``fp8(w / s)``
with a per-tensor float32 ``<layer>.scale_weight``, the rest bf16, a ``scaled_fp8`` marker whose dtype
names the fp8 format, as tests/fixtures/comfy_files.py writes the tiny one); ``write_nvfp4`` quantizes
every Linear weight with comfy-kitchen's own ``TensorCoreNVFP4Layout`` (packed fp4 padded to 16 x 16,
fp8 block scales, a tensor scale), declared by the header's ``_quantization_metadata`` (what ComfyUI's
loader reads). Nothing here imports torch at module level.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MARKER = "scaled_fp8"
SIZES = {"F8_E4M3": 1, "F32": 4, "BF16": 2, "U8": 1}


def _fp8_entries(specs: list[tuple], marker: int,
                 bf16: tuple[str, ...] = ()) -> list[tuple[str, str, tuple[int, ...], tuple | None]]:
    """(key, safetensors dtype, shape, init or None for a scale) in data order: every Linear
    weight fp8 with its scale right after it (convolutions, biases, norms and modulations stay
    bf16, as in Comfy-Org's files, and 2-D weights named by ``bf16``: an embedding), the marker
    (``marker`` elements) last."""
    out: list[tuple[str, str, tuple[int, ...], tuple | None]] = []
    for name, shape, init in specs:
        if name.endswith(".weight") and len(shape) == 2 and not name.endswith(bf16):
            out.append((name, "F8_E4M3", tuple(shape), init))
            out.append((name.removesuffix(".weight") + ".scale_weight", "F32", (), None))
        else:
            out.append((name, "BF16", tuple(shape), init))
    return [*out, (MARKER, "F8_E4M3", (marker,), None)]


def _header(entries: list[tuple], metadata: dict[str, str]) -> tuple[bytes, int]:
    """The safetensors header (8-byte aligned as safetensors writes it) and the data's length;
    every tensor's offset is checked to be aligned to its element size."""
    header: dict[str, Any] = {}
    off = 0
    for key, dtype, shape, _init in entries:
        if off % SIZES[dtype]:
            raise ValueError(f"{key} would start at offset {off}, not aligned to {SIZES[dtype]} bytes")
        n = SIZES[dtype] * math.prod(shape)
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt", **metadata}
    hb = json.dumps(header, separators=(",", ":")).encode()
    return hb + b" " * ((8 - len(hb) % 8) % 8), off


def write_fp8_scaled(
    path: Path, specs: list[tuple], device: str, seed: int, meta: dict, marker: int = 0, bf16: tuple[str, ...] = (),
    raw: dict[str, bytes] | None = None,
) -> dict:
    """Stream random weights (``init`` as make_wan_sd's: normal with a std, ones, zeros) into a
    ComfyUI fp8_scaled file. A marker of 2 elements asks ComfyUI for full-precision matmuls
    (weights dequantised); an empty one lets it run fp8 matmuls where the GPU has them. ``raw``:
    byte strings stored as uint8 tensors after the weights (a tokenizer's vocabulary)."""
    import torch

    raw = raw or {}
    weights = _fp8_entries(specs, marker, bf16)
    entries = [*weights[:-1], *((k, "U8", (len(v),), None) for k, v in raw.items()), weights[-1]]
    hb, data_len = _header(entries, meta)
    gen = torch.Generator(device=device).manual_seed(seed)
    tmp, scale, fp8_bytes = Path(str(path) + ".part"), None, 0
    with open(tmp, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for key, dtype, shape, init in entries[:-1]:
            if dtype == "U8":
                f.write(raw[key])
                continue
            if dtype == "F32":  # the scale of the weight just written
                _write(f, scale.reshape(1))
                continue
            w = _random(torch, shape, init, device, gen)
            if dtype == "F8_E4M3":
                scale = (w.abs().amax() / FP8_MAX).clamp_min(1e-12).float()
                w = (w / scale).to(torch.float8_e4m3fn)
                fp8_bytes += w.numel()
            _write(f, w if dtype == "F8_E4M3" else w.to(torch.bfloat16))
        f.write(bytes(marker))
    tmp.replace(path)
    scales = sum(1 for e in entries if e[1] == "F32")
    return {"file_bytes": 8 + len(hb) + data_len, "fp8_bytes": fp8_bytes, "scales": scales}


def _random(torch, shape: tuple[int, ...], init: tuple, device: str, gen) -> Any:
    if init[0] in ("ones", "zeros"):
        return getattr(torch, init[0])(shape, device=device)
    return torch.randn(shape, device=device, generator=gen).mul_(init[1])


def _write(f, t) -> None:
    """A tensor's raw bytes (little-endian, as safetensors stores them) to ``f``."""
    import torch

    mv = memoryview(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    while len(mv):
        mv = mv[f.write(mv) :]


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def _nvfp4_entries(specs: list[tuple]) -> tuple[list[tuple], dict[str, dict]]:
    """(key, safetensors dtype, stored shape, (init, shape) or None for a scale) in data order, and
    the quantization metadata's layers."""
    entries: list[tuple] = []
    layers: dict[str, dict] = {}
    for name, shape, init in specs:
        if not (name.endswith(".weight") and len(shape) == 2):
            entries.append((name, "BF16", tuple(shape), (init, tuple(shape))))
            continue
        rows, cols = _round(shape[0], 16), _round(shape[1], 16)
        layer = name.removesuffix(".weight")
        entries += [(name, "U8", (rows, cols // 2), (init, tuple(shape))),
                    (layer + ".weight_scale", "F8_E4M3", (_round(rows, 128), _round(cols // 16, 4)), None),
                    (layer + ".weight_scale_2", "F32", (), None)]
        layers[layer] = {"format": "nvfp4"}
    return entries, layers


def write_nvfp4(path: Path, specs: list[tuple], device: str, seed: int, meta: dict) -> dict:
    """Stream random weights into a ComfyUI NVFP4 file (the module's docstring)."""
    import torch
    from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout

    entries, layers = _nvfp4_entries(specs)
    quant = json.dumps({"format_version": "1.0", "layers": layers})
    hb, data_len = _header(entries, {**meta, "_quantization_metadata": quant})
    gen = torch.Generator(device=device).manual_seed(seed)
    tmp, pending, stored = Path(str(path) + ".part"), [], 0
    with open(tmp, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for _key, dtype, _shape, made in entries:
            if made is None:  # a scale of the weight just written
                t = pending.pop(0)
            elif dtype == "U8":
                w = _random(torch, made[1], made[0], device, gen).to(torch.bfloat16)
                t, params = TensorCoreNVFP4Layout.quantize(w)
                pending = [params.block_scale, params.scale.reshape(1)]
                stored += t.numel() + params.block_scale.numel() + 4
            else:
                t = _random(torch, made[1], made[0], device, gen).to(torch.bfloat16)
            _write(f, t)
    tmp.replace(path)
    return {"file_bytes": 8 + len(hb) + data_len, "nvfp4_bytes": stored, "layers": len(layers)}

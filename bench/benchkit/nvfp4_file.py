"""single_file_node.py's denoiser as a ComfyUI NVFP4 file: the native anchor's tensor list with every
Linear weight quantized by comfy-kitchen's own ``TensorCoreNVFP4Layout`` (packed fp4 weight padded
to 16 x 16, fp8 block scales, a per-tensor scale), declared by the header's
``_quantization_metadata`` (what ComfyUI's loader reads), the rest bf16; streamed tensor by tensor
like the fp8_scaled writer. Nothing here imports torch at module level."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from .single_file import _header, _random, _write


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def _entries(specs: list[tuple]) -> tuple[list[tuple], dict[str, dict]]:
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
    import torch
    from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout

    entries, layers = _entries(specs)
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

"""A file's scaled weight decoded to compute values at load, for the models that keep no quantized
storage (a text encoder's weights in a file that mixes fp8 and int8, a VAE, an all-in-one
checkpoint's parts): int8 as comfy-kitchen decodes it, fp8 as ComfyUI's ``w.to(dtype) * scale``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .fp8 import INT8, check_int8_scale, decode_int8, dequantize, scale_value
from .inspect import SingleFileError


def decoded_weight(path: Path, layer: str, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   group: int = 0) -> torch.Tensor:
    """``weight`` of ``layer`` in ``dtype``: int8 as ``(q.float() * scale).to(dtype)`` (per tensor or
    row; ``group``: a convrot one rotated back), another float as ``w.to(dtype) * scale`` (per tensor
    only); a bad scale refused naming file and layer."""
    try:
        if weight.dtype == INT8:
            return decode_int8(weight, check_int8_scale(scale, layer, weight, str(path)), dtype, group)
        if scale.numel() != 1:
            raise ValueError(f"{path}: the scale of {layer} has shape {tuple(scale.shape)}; scaled float "
                             "weights decoded at load take per-tensor scales only")
        return dequantize(weight, scale_value(scale, dtype), dtype)
    except ValueError as exc:
        raise SingleFileError(str(exc)) from exc

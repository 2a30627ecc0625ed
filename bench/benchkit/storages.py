"""The weight storages a bench model's blocks can take (``wan_bench.py --storage``): the loader's fp8
dtypes (`models.store_fp8_as`), diffusers' GGUF layers (`gguf`), ComfyUI's W4A8 and NVFP4 (`stored`) and int8
(`int8`) layers; ``bf16`` leaves the model as built."""

from __future__ import annotations

from typing import Any

import torch

from .gguf import QTYPES as GGUF_TYPES
from .gguf import to_gguf
from .int8 import STORAGES as INT8_STORAGES
from .int8 import to_int8
from .models import FP8_STORAGES, blocks_of, store_fp8_as
from .stored import STORAGES as STORED
from .stored import to_stored

STORAGES = ("bf16", *FP8_STORAGES, *GGUF_TYPES, *STORED, *INT8_STORAGES)
CAST = (*FP8_STORAGES, *INT8_STORAGES, *GGUF_TYPES)  # dequantised by the engine's hooks: no plain resident forward
HELP = ("weight storage (main model only): fp8 Linear weights computing in bf16 (_fast: fp8 matmuls); gguf_* "
        "diffusers' GGUF layers (benchkit/gguf.py); w4a8 / w4a4 / nvfp4 / mxfp8 the pack's stored layers over comfy-kitchen's "
        "(benchkit/stored.py); int8[_convrot] ComfyUI int8_tensorwise layers (benchkit/int8.py)")


def apply(m: torch.nn.Module, storage: str, row: Any, cast_each_forward: bool = False) -> None:
    """Give ``m`` the ``storage`` (a row says what was made of a quantized one)."""
    if storage in FP8_STORAGES:
        store_fp8_as(m, storage, cast_each_forward)
    elif storage in GGUF_TYPES:
        row(section="gguf", storage=storage, layers=to_gguf(m, blocks_of(m), storage))
    elif storage in STORED:
        row(section=storage, storage=storage, layers=to_stored(m, blocks_of(m), storage))
    elif storage in INT8_STORAGES:
        row(section="int8", storage=storage, rotating=to_int8(m, blocks_of(m), storage))

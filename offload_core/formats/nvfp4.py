"""ComfyUI's NVFP4 layers (comfy-kitchen's ``TensorCoreNVFP4Layout``: a packed fp4 weight padded to
16 × 16, fp8 block scales under ``weight_scale`` and a per-tensor ``weight_scale_2``) decoded to the
compute dtype at load by comfy-kitchen's own ``dequantize_nvfp4``.

Why only decoded, and only for text encoders: they run once a prompt (ComfyUI's LTX-2 blueprints
name an nvfp4-mixed Gemma 3), while NVFP4 matmuls need Blackwell tensor cores this engine does not
stream for; comfy-kitchen is the reference for the format, so its decode is used as is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .fp8 import SCALE_KEY
from .inspect import SingleFileError

NVFP4 = "nvfp4"
TENSOR_SCALE = ".weight_scale_2"
AWQ_SCALE = ".pre_quant_scale"  # an input scaling (AWQ) a decoded weight does not carry


def decode_nvfp4(path: Path, state: dict[str, torch.Tensor], layers: list[str], dtype: torch.dtype) -> set[str]:
    """Replaces each NVFP4 layer's weight and scales in ``state`` (scales as `single_file.read_checkpoint`
    spells them) by its decoded weight, still padded to 16 × 16; returns those weights' keys, to be
    cut to the model's shapes."""
    try:
        import comfy_kitchen
    except ImportError as exc:
        raise SingleFileError(f"{path} has NVFP4 layers ({layers[:3]}): reading them needs comfy-kitchen "
                              "(ComfyUI's 2026 requirements install it)") from exc
    awq = [layer for layer in layers if layer + AWQ_SCALE in state]
    if awq:
        raise SingleFileError(f"{path}: NVFP4 layers {awq[:3]} scale their input (AWQ pre_quant_scale), which this "
                              "pack does not decode; use a bf16, fp8 or fp8_scaled file of the model")
    padded = set()
    for layer in layers:
        try:
            packed, blocks, scale = (state.pop(layer + suffix) for suffix in (".weight", SCALE_KEY, TENSOR_SCALE))
        except KeyError as exc:
            raise SingleFileError(f"{path}: the NVFP4 layer {layer} lacks {exc.args[0]}: the file is incomplete"
                                  ) from exc
        blocks = blocks.view(torch.float8_e4m3fn) if blocks.dtype == torch.uint8 else blocks
        state[layer + ".weight"] = comfy_kitchen.dequantize_nvfp4(packed, scale.float(), blocks, dtype)
        padded.add(layer + ".weight")
    return padded

"""ComfyUI's NVFP4 layers (comfy-kitchen's ``TensorCoreNVFP4Layout``): a packed fp4 (E2M1) weight
padded to 16 × 16, fp8 block scales (one per 16 values of a row) under ``weight_scale`` in cuBLAS's
tiled ("swizzled") layout, a per-tensor ``weight_scale_2`` and, for AWQ files, an input scaling
``pre_quant_scale``.

They are kept as stored (`NVFP4Linear`): 4.5 bits a weight are what is pinned, streamed and
kept, and each layer computes as ComfyUI's does on a card without fp4 tensor cores (its
``nvfp4`` ops are "emulated" below Blackwell): ``F.linear(x, dequantize_nvfp4(...)[:out, :in])``,
comfy-kitchen's decode (on a GPU the pack's kernel, its bits in one pass: `tiled_kernel`); so do
text encoders (an nvfp4-mixed Gemma 3 decoded would take the RAM its file was chosen to save). No
NVFP4 matmuls: they need Blackwell tensor cores, which the engine has not been measured on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from ..log import get_logger
from . import tiled_kernel
from .fp8 import INPUT_KEY, SCALE_KEY
from .inspect import SingleFileError
from .stored_linear import StoredLinear, kitchen_module, layers_holding, opaque
from .tiled_scales import round_up, rows_of, tiled_shape

NVFP4 = "nvfp4"
BLOCK = 16  # values per block scale
TENSOR_SCALE = ".weight_scale_2"
AWQ_SCALE = ".pre_quant_scale"  # an input scaling (AWQ)
log = get_logger("nvfp4")


def kitchen() -> ModuleType:
    """`stored_linear.kitchen_module` for this format."""
    return kitchen_module("comfy_kitchen", "NVFP4")


@opaque("nvfp4_decode", lambda packed, _t, _b, dtype: packed.new_empty((packed.shape[0], packed.shape[1] * 2),
                                                                      dtype=dtype))
def _decode(packed: torch.Tensor, tensor: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A layer's padded weight in ``dtype``: the pack's kernel where it runs, comfy-kitchen's decode else."""
    weight = tiled_kernel.nvfp4(packed, tensor, blocks, dtype)
    return kitchen().dequantize_nvfp4(packed, tensor, blocks, dtype) if weight is None else weight


class NVFP4Linear(StoredLinear):
    """``nn.Linear``'s interface over NVFP4 storage: the weight decoded to ``compute`` at each
    forward, cut to the layer's shape, then the input's dtype."""

    FORMAT, NAME, TENSORS = NVFP4, "nvfp4", ("weight_scale", "weight_scale_2", "pre_quant_scale")

    def __init__(self, in_features: int, out_features: int, bias: bool, compute: torch.dtype, awq: torch.dtype | None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(in_features, out_features, bias, compute, device)
        kitchen()  # (where comfy-kitchen is missing: refused at load, not at the first forward)
        rows, cols = round_up(out_features, BLOCK), round_up(in_features, BLOCK)
        self.stored("weight", rows, cols // 2, dtype=torch.uint8, device=device)
        self.stored("weight_scale", *tiled_shape(rows, cols // BLOCK), dtype=torch.float8_e4m3fn, device=device)
        self.stored("weight_scale_2", dtype=torch.float32, device=device)
        if awq is not None:
            self.stored("pre_quant_scale", in_features, dtype=awq, device=device)
        else:
            self.register_buffer("pre_quant_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:  # ComfyUI: the input times the scale, in the input's dtype
            x = x * self.pre_quant_scale.to(x.dtype)
        return self.decoded_forward(x, _decode(self.weight, self.weight_scale_2, self.weight_scale, self.compute))


@dataclass(frozen=True)
class Held:
    """An NVFP4 layer's tensors beside its weight, as the file stores them, and its weight's rows."""

    blocks: torch.Tensor  # fp8 block scales, comfy-kitchen's tiled layout
    scale: torch.Tensor  # the per-tensor scale, float32
    awq: torch.Tensor | None  # the input scaling, if any
    rows: int


class Kind:
    """NVFP4 as the loaders meet it (`stored_linear.StoredKind`)."""

    NAME, TENSORS = "NVFP4", NVFP4Linear.TENSORS

    def pop(self, path: Path, state: dict[str, torch.Tensor]) -> dict[str, Held]:
        """Each NVFP4 layer's tensors beside its weight (a packed uint8 weight with a tensor scale),
        by file layer; input scales (for fp4 matmuls only) dropped, logged once."""
        extras, inputs = {}, 0
        for layer in layers_holding(state, TENSOR_SCALE, ".weight", torch.uint8):
            blocks, awq = state.pop(layer + SCALE_KEY), state.pop(layer + AWQ_SCALE, None)
            blocks = blocks.view(torch.float8_e4m3fn) if blocks.dtype == torch.uint8 else blocks
            scale = state.pop(layer + TENSOR_SCALE).float().reshape(())
            extras[layer] = Held(blocks, scale, awq, state[layer + ".weight"].shape[0])
            inputs += state.pop(layer + INPUT_KEY, None) is not None
        if inputs:
            log.info("%s: the input scales of %d NVFP4 layers are not used (they serve fp4 matmuls; the layers "
                     "compute from their decoded weights, as ComfyUI's do below Blackwell)", path.name, inputs)
        return extras

    def attach(self, state: dict[str, torch.Tensor], extras: dict[str, Held],
               traced: dict[str, tuple[str, torch.Tensor | slice]]) -> None:
        """Under the names `NVFP4Linear` holds: a part of a split layer its rows' block scales,
        re-tiled; the tensor scale and the input scaling whole."""
        for layer, (source, rows) in traced.items():
            held = extras[source]
            state[f"{layer}.weight_scale"] = rows_of(held.blocks, rows, held.rows)
            state[f"{layer}.weight_scale_2"] = held.scale
            if held.awq is not None:
                state[f"{layer}.pre_quant_scale"] = held.awq

    def layers(self, state: dict[str, torch.Tensor]) -> list[str]:
        return layers_holding(state, TENSOR_SCALE, ".weight", torch.uint8)

    def decoded(self, state: dict[str, torch.Tensor], name: str, shape: tuple[int, int], dtype: torch.dtype
                ) -> torch.Tensor:
        """The weight comfy-kitchen decodes, cut to ``shape``, its tensors taken out of ``state``;
        an AWQ layer cannot be (its input scaling)."""
        if f"{name}.pre_quant_scale" in state:
            raise SingleFileError(f"the NVFP4 layer {name} scales its input (AWQ pre_quant_scale) but diffusers keeps "
                                  "it in float32, so it cannot be decoded; use a bf16, fp8 or fp8_scaled file")
        scale, blocks = state.pop(f"{name}.weight_scale_2"), state.pop(f"{name}.weight_scale")
        weight = kitchen().dequantize_nvfp4(state.pop(f"{name}.weight"), scale, blocks, dtype)
        return weight[: shape[0], : shape[1]].contiguous()

    def make(self, name: str, linear: torch.nn.Linear, state: dict[str, torch.Tensor], compute: torch.dtype
             ) -> NVFP4Linear:
        awq = state.get(f"{name}.pre_quant_scale")
        return NVFP4Linear(linear.in_features, linear.out_features, linear.bias is not None, compute,
                           None if awq is None else awq.dtype, device="meta")

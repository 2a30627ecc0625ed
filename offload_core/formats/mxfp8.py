"""ComfyUI's MXFP8 layers (comfy-kitchen's ``TensorCoreMXFP8Layout``): an fp8 (e4m3) weight padded to
32 × 32 and one power-of-two (E8M0) scale per 32 values of a row under ``weight_scale``, in cuBLAS's
tiled layout (`tiled_scales`).

Kept as stored (`MXFP8Linear`): the fp8 bytes and their scales are pinned, streamed and kept, and
each layer computes as ComfyUI's does on a card without MXFP8 tensor cores (below Blackwell its
``mxfp8`` ops are emulated): ``F.linear(x, dequantize_mxfp8(...)[:out, :in])``, comfy-kitchen's own
decode. Found by their ``comfy_quant`` entries: the scale's name is an fp8_scaled file's.
"""

from __future__ import annotations

from types import ModuleType

import torch

from .fp8 import INPUT_KEY, SCALE_KEY
from .stored_linear import StoredLinear, kitchen_module
from .tiled_scales import rows_of, tiled_shape

FORMAT = "mxfp8"
BLOCK = 32  # values per block scale
E8M0 = torch.float8_e8m0fnu


def kitchen() -> ModuleType:
    """`stored_linear.kitchen_module` for this format."""
    return kitchen_module("comfy_kitchen", "MXFP8")


def _round32(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


class MXFP8Linear(StoredLinear):
    """``nn.Linear``'s interface over MXFP8 storage: the weight decoded to ``compute`` at each
    forward, cut to the layer's shape, then the input's dtype."""

    FORMAT, NAME, TENSORS = FORMAT, "mxfp8", ("weight_scale",)

    def __init__(self, in_features: int, out_features: int, bias: bool, compute: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__(in_features, out_features, bias, compute, device)
        self.decode = kitchen().dequantize_mxfp8  # (resolved once: a compiled block traces the call)
        rows, cols = _round32(out_features), _round32(in_features)
        self.stored("weight", rows, cols, dtype=torch.float8_e4m3fn, device=device)
        self.stored("weight_scale", *tiled_shape(rows, cols // BLOCK), dtype=E8M0, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.decode(self.weight, self.weight_scale, self.compute)
        weight = weight[: self.out_features, : self.in_features].to(x.dtype)
        return torch.nn.functional.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))


def pop_extras(state: dict[str, torch.Tensor], layers: list[str]) -> dict[str, tuple[torch.Tensor, int]]:
    """The MXFP8 ``layers``' block scales (as `single_file.read_checkpoint` spells them, E8M0 bytes)
    and weights' rows, taken out of a file's state before the fp8 scales are, by file layer; their
    input scales (for MXFP8 matmuls) dropped."""
    extras = {}
    for layer in layers:
        if layer + SCALE_KEY in state:
            scales = state.pop(layer + SCALE_KEY)
            extras[layer] = (scales.view(E8M0) if scales.dtype == torch.uint8 else scales,
                             state[layer + ".weight"].shape[0])
        state.pop(layer + INPUT_KEY, None)
    return extras


def attach(state: dict[str, torch.Tensor], extras: dict[str, tuple[torch.Tensor, int]],
           traced: dict[str, tuple[str, torch.Tensor | slice]]) -> None:
    """Put the block scales back beside the converted weights, a part of a split layer its rows'."""
    for layer, (source, rows) in traced.items():
        scales, count = extras[source]
        state[f"{layer}.weight_scale"] = rows_of(scales, rows, count)


class Kind:
    """MXFP8 as the loaders meet it (`stored_linear.StoredKind`)."""

    NAME, TENSORS = "MXFP8", MXFP8Linear.TENSORS

    def layers(self, state: dict[str, torch.Tensor]) -> list[str]:
        """The layers `attach` gave E8M0 block scales (fp8 weights beside them)."""
        return sorted(layer for layer in (k.removesuffix(".weight_scale") for k in state if k.endswith(".weight_scale"))
                      if state[layer + ".weight_scale"].dtype == E8M0)

    def decoded(self, state: dict[str, torch.Tensor], name: str, shape: tuple[int, int], dtype: torch.dtype
                ) -> torch.Tensor:
        """The weight comfy-kitchen decodes, cut to ``shape``, its tensors taken out of ``state``."""
        scales = state.pop(f"{name}.weight_scale")
        weight = kitchen().dequantize_mxfp8(state.pop(f"{name}.weight"), scales, dtype)
        return weight[: shape[0], : shape[1]].contiguous()

    def make(self, name: str, linear: torch.nn.Linear, state: dict[str, torch.Tensor], compute: torch.dtype
             ) -> MXFP8Linear:
        return MXFP8Linear(linear.in_features, linear.out_features, linear.bias is not None, compute, device="meta")

"""ComfyUI's MXFP8 layers (comfy-kitchen's ``TensorCoreMXFP8Layout``): an fp8 (e4m3) weight padded to
32 × 32 and one power-of-two (E8M0) scale per 32 values of a row under ``weight_scale``, in cuBLAS's
tiled layout (`tiled_scales`).

Kept as stored (`MXFP8Linear`): the fp8 bytes and their scales are pinned, streamed and kept, and
each layer computes as ComfyUI's does on a card without MXFP8 tensor cores (below Blackwell its
``mxfp8`` ops are emulated): ``F.linear(x, dequantize_mxfp8(...)[:out, :in])``, comfy-kitchen's
decode (on a GPU the pack's kernel, its bits in one pass: `tiled_kernel`). Found by their
``comfy_quant`` entries: the scale's name is an fp8_scaled file's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from . import tiled_kernel
from .fp8 import INPUT_KEY, SCALE_KEY
from .stored_linear import StoredLinear, kitchen_module, layers_holding, opaque
from .tiled_scales import round_up, rows_of, tiled_shape

FORMAT = "mxfp8"
BLOCK = 32  # values per block scale
E8M0 = torch.float8_e8m0fnu


def kitchen() -> ModuleType:
    """`stored_linear.kitchen_module` for this format."""
    return kitchen_module("comfy_kitchen", "MXFP8")


@opaque("mxfp8_decode", lambda q, _b, dtype: q.new_empty(q.shape, dtype=dtype))
def _decode(q: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A layer's padded weight in ``dtype``: the pack's kernel where it runs, comfy-kitchen's decode else."""
    weight = tiled_kernel.mxfp8(q, blocks, dtype)
    return kitchen().dequantize_mxfp8(q, blocks, dtype) if weight is None else weight


class MXFP8Linear(StoredLinear):
    """``nn.Linear``'s interface over MXFP8 storage: the weight decoded to ``compute`` at each
    forward, cut to the layer's shape, then the input's dtype."""

    FORMAT, NAME, TENSORS = FORMAT, "mxfp8", ("weight_scale",)

    def __init__(self, in_features: int, out_features: int, bias: bool, compute: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__(in_features, out_features, bias, compute, device)
        kitchen()  # (where comfy-kitchen is missing: refused at load, not at the first forward)
        rows, cols = round_up(out_features, BLOCK), round_up(in_features, BLOCK)
        self.stored("weight", rows, cols, dtype=torch.float8_e4m3fn, device=device)
        self.stored("weight_scale", *tiled_shape(rows, cols // BLOCK), dtype=E8M0, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoded_forward(x, _decode(self.weight, self.weight_scale, self.compute))


@dataclass(frozen=True)
class Kind:
    """MXFP8 as the loaders meet it (`stored_linear.StoredKind`): the file's ``file_layers`` declared
    mxfp8 (its block scales are spelled as fp8_scaled files spell theirs)."""

    file_layers: tuple[str, ...]
    NAME, TENSORS = "MXFP8", MXFP8Linear.TENSORS

    def pop(self, path: Path, state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
        """Each layer's block scales (E8M0 bytes) and weight's rows, by file layer; their input
        scales (for MXFP8 matmuls) dropped."""
        extras = {}
        for layer in self.file_layers:
            if layer + SCALE_KEY in state:
                scales = state.pop(layer + SCALE_KEY)
                extras[layer] = (scales.view(E8M0) if scales.dtype == torch.uint8 else scales,
                                 state[layer + ".weight"].shape[0])
            state.pop(layer + INPUT_KEY, None)
        return extras

    def attach(self, state: dict[str, torch.Tensor], extras: dict[str, tuple[torch.Tensor, int]],
               traced: dict[str, tuple[str, torch.Tensor | slice]]) -> None:
        """The block scales beside the converted weights, a part of a split layer its rows', re-tiled."""
        for layer, (source, rows) in traced.items():
            scales, count = extras[source]
            state[f"{layer}.weight_scale"] = rows_of(scales, rows, count)

    def layers(self, state: dict[str, torch.Tensor]) -> list[str]:
        """The layers `attach` gave E8M0 block scales (fp8 weights beside them)."""
        return layers_holding(state, ".weight_scale", ".weight_scale", E8M0)

    def decoded(self, state: dict[str, torch.Tensor], name: str, shape: tuple[int, int], dtype: torch.dtype
                ) -> torch.Tensor:
        """The weight comfy-kitchen decodes, cut to ``shape``, its tensors taken out of ``state``."""
        scales = state.pop(f"{name}.weight_scale")
        weight = kitchen().dequantize_mxfp8(state.pop(f"{name}.weight"), scales, dtype)
        return weight[: shape[0], : shape[1]].contiguous()

    def make(self, name: str, linear: torch.nn.Linear, state: dict[str, torch.Tensor], compute: torch.dtype
             ) -> MXFP8Linear:
        return MXFP8Linear(linear.in_features, linear.out_features, linear.bias is not None, compute, device="meta")

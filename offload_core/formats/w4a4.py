"""ComfyUI's ConvRot W4A4 layers (comfy-kitchen's ``convrot_w4a4``): int4 weights rotated by a
regular Hadamard matrix in groups of ``convrot_groupsize`` columns, packed two per int8 byte
``[out, in / 2]``, one float32 scale per row under ``weight_scale``; run by comfy-kitchen's own
``convrot_w4a4_linear`` (the input rotated and quantized to int4, or int8 with ``linear_dtype``
int8; its kernels on a GPU, its eager ops elsewhere): the call ComfyUI's layer makes, so the outputs
are ComfyUI's. A `stored_linear.StoredLinear`; where comfy-kitchen is missing the file is refused.

Why the layers are found by their ``comfy_quant`` entries: an int8 weight with a per-row
``weight_scale`` is also how an int8_tensorwise layer is stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from .fp8 import SCALE_KEY
from .stored_linear import StoredLinear, kitchen_module, layers_holding, opaque

FORMAT = "convrot_w4a4"
GROUP = 64  # comfy-kitchen's int4 quantization group (ComfyUI fixes it)


@dataclass(frozen=True)
class W4A4Conf:
    """A layer's ``comfy_quant`` entry as ComfyUI reads it (entry first, then its ``params``)."""

    convrot_groupsize: int = 256
    linear_dtype: str = "int4"

    @classmethod
    def of(cls, entry: dict) -> W4A4Conf:
        params = entry.get("params") if isinstance(entry.get("params"), dict) else {}
        return cls(int(entry.get("convrot_groupsize", params.get("convrot_groupsize", 256))),
                   str(entry.get("linear_dtype", params.get("linear_dtype", "int4"))))


def kitchen() -> ModuleType:
    """`stored_linear.kitchen_module` for this format."""
    return kitchen_module("comfy_kitchen.tensor.convrot_w4a4", "ConvRot W4A4 (convrot_w4a4)")


@opaque("w4a4_linear", lambda x, qweight, *_: x.new_empty((*x.shape[:-1], qweight.shape[0])))
def _linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            convrot_groupsize: int, linear_dtype: str) -> torch.Tensor:
    """comfy-kitchen's ConvRot W4A4 linear (the input's dtype out)."""
    return kitchen().convrot_w4a4_linear(x, qweight, scales, bias=bias, convrot_groupsize=convrot_groupsize,
                                         quant_group_size=GROUP, linear_dtype=linear_dtype)


class W4A4Linear(StoredLinear):
    """``nn.Linear``'s interface over ConvRot W4A4 storage."""

    FORMAT, NAME, TENSORS = FORMAT, "w4a4", ("weight_scale",)

    def __init__(self, in_features: int, out_features: int, bias: bool, conf: W4A4Conf, compute: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__(in_features, out_features, bias, compute, device)
        self.conf = conf
        kitchen()  # (where comfy-kitchen is missing: refused at load, not at the first forward)
        self.stored("weight", out_features, in_features // 2, dtype=torch.int8, device=device)
        self.stored("weight_scale", out_features, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.weight_scale, self.bias, self.conf.convrot_groupsize,
                       self.conf.linear_dtype)

    def extra_repr(self) -> str:
        conf = self.conf
        return f"{super().extra_repr()}, convrot_groupsize={conf.convrot_groupsize}, linear_dtype={conf.linear_dtype}"


@dataclass(frozen=True)
class Kind:
    """ConvRot W4A4 as the loaders meet it (`stored_linear.StoredKind`), for a file of one rotation."""

    conf: W4A4Conf
    file_layers: tuple[str, ...]  # the file's layers declared convrot_w4a4
    NAME, TENSORS = "ConvRot W4A4", W4A4Linear.TENSORS

    def pop(self, path: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layers' row scales (spelled as `single_file.read_checkpoint` spells int8 and fp8 ones),
        by file layer."""
        return {layer: state.pop(layer + SCALE_KEY).float().reshape(-1)
                for layer in self.file_layers if layer + SCALE_KEY in state}

    def attach(self, state: dict[str, torch.Tensor], extras: dict[str, torch.Tensor],
               traced: dict[str, tuple[str, torch.Tensor | slice]]) -> None:
        """The row scales beside the converted weights, each part of a split layer its rows'."""
        for layer, (source, rows) in traced.items():
            state[f"{layer}.weight_scale"] = extras[source][rows]

    def layers(self, state: dict[str, torch.Tensor]) -> list[str]:
        """The layers `attach` gave a row scale under the name the layer holds (int8 weights)."""
        return layers_holding(state, ".weight_scale", ".weight", torch.int8)

    def decoded(self, state: dict[str, torch.Tensor], name: str, shape: tuple[int, int], dtype: torch.dtype
                ) -> torch.Tensor:
        """The weight rotated back and decoded by comfy-kitchen, its tensors taken out of ``state``."""
        return kitchen().dequantize_convrot_w4a4_weight(state.pop(f"{name}.weight"), state.pop(f"{name}.weight_scale"),
                                                        self.conf.convrot_groupsize, GROUP, dtype)

    def make(self, name: str, linear: torch.nn.Linear, state: dict[str, torch.Tensor], compute: torch.dtype
             ) -> W4A4Linear:
        return W4A4Linear(linear.in_features, linear.out_features, linear.bias is not None, self.conf, compute,
                          device="meta")

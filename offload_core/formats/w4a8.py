"""ComfyUI's W4A8 layers (comfy-kitchen's ``asym_w4a8_int8``, the form MiniMax-H3 circulates in):
int4 weights packed two per int8 byte ``[out, in / 2]``, fp8 group scales ``weight_s_rel``,
float32 channel scales ``weight_s_channel`` and an optional 16-level ``weight_codebook``, run by
comfy-kitchen's own ``w4a8_int8_linear`` (its kernels on a GPU, its eager ops elsewhere): the call
ComfyUI's quantized Linear makes, so the outputs are ComfyUI's. A `stored_linear.StoredLinear`.
comfy-kitchen comes with ComfyUI (2026 tree); where it is missing, a W4A8 file is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from .stored_linear import StoredLinear, kitchen_module, opaque

FORMAT = "asym_w4a8_int8"
TENSORS = ("weight_s_rel", "weight_s_channel", "weight_codebook")  # beside ``<layer>.weight``


@dataclass(frozen=True)
class W4A8Conf:
    """A layer's ``comfy_quant`` entry as ComfyUI reads it (entry first, then its ``params``)."""

    group_size: int = 16
    convrot_groupsize: int = 256

    @classmethod
    def of(cls, entry: dict) -> W4A8Conf:
        params = entry.get("params") if isinstance(entry.get("params"), dict) else {}
        return cls(int(entry.get("group_size", params.get("group_size", 16))),
                   int(entry.get("convrot_groupsize", params.get("convrot_groupsize", 256))))


def kitchen() -> ModuleType:
    """`stored_linear.kitchen_module` for this format."""
    return kitchen_module("comfy_kitchen.tensor.w4a8_int8", "W4A8 (asym_w4a8_int8)")


@opaque("w4a8_linear", lambda x, qdata, *_: x.new_empty((*x.shape[:-1], qdata.shape[0])))
def _linear(x: torch.Tensor, qdata: torch.Tensor, s_rel: torch.Tensor, s_channel: torch.Tensor,
            codebook: torch.Tensor | None, bias: torch.Tensor | None, group_size: int, convrot_groupsize: int
            ) -> torch.Tensor:
    """comfy-kitchen's W4A8 linear, in the input's dtype as ComfyUI's layer gives it."""
    return kitchen().w4a8_int8_linear(x, qdata, s_rel, s_channel, codebook=codebook, correction=None, bias=bias,
                                      group_size=group_size, convrot_groupsize=convrot_groupsize, out_dtype=x.dtype)


class W4A8Linear(StoredLinear):
    """``nn.Linear``'s interface over W4A8 storage; the output takes the input's dtype, as
    ComfyUI's layer gives it."""

    FORMAT, NAME, TENSORS = FORMAT, "w4a8", TENSORS

    def __init__(self, in_features: int, out_features: int, bias: bool, conf: W4A8Conf, codebook: bool,
                 compute: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__(in_features, out_features, bias, compute, device)
        self.conf = conf
        kitchen()  # (where comfy-kitchen is missing: refused at load, not at the first forward)
        self.stored("weight", out_features, in_features // 2, dtype=torch.int8, device=device)
        self.stored("weight_s_rel", out_features, in_features // conf.group_size, dtype=torch.float8_e4m3fn,
                    device=device)
        self.stored("weight_s_channel", out_features, dtype=torch.float32, device=device)
        if codebook:
            self.stored("weight_codebook", 16, dtype=torch.float32, device=device)
        else:
            self.register_buffer("weight_codebook", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.weight_s_rel, self.weight_s_channel, self.weight_codebook, self.bias,
                       self.conf.group_size, self.conf.convrot_groupsize)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.conf.group_size}, convrot_groupsize={self.conf.convrot_groupsize}"


@dataclass(frozen=True)
class Kind:
    """W4A8 as the loaders meet it (`stored_linear.StoredKind`), for a file of one group geometry."""

    conf: W4A8Conf
    NAME, TENSORS = "W4A8", TENSORS

    def pop(self, path: Path, state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """The W4A8 layers' tensors other than the weight, by file layer: {"weight_s_rel": ...}."""
        extras: dict[str, dict[str, torch.Tensor]] = {}
        for key in [k for k in state if k.endswith(tuple("." + t for t in TENSORS))]:
            layer, _, name = key.rpartition(".")
            extras.setdefault(layer, {})[name] = state.pop(key)
        return extras

    def attach(self, state: dict[str, torch.Tensor], extras: dict[str, dict[str, torch.Tensor]],
               traced: dict[str, tuple[str, torch.Tensor | slice]]) -> None:
        """The tensors beside the converted weights: a part of a split layer its rows' scales, the
        codebook whole."""
        for layer, (source, rows) in traced.items():
            held = extras[source]
            state[f"{layer}.weight_s_rel"] = held["weight_s_rel"][rows]
            state[f"{layer}.weight_s_channel"] = held["weight_s_channel"].reshape(-1)[rows]
            if "weight_codebook" in held:
                state[f"{layer}.weight_codebook"] = held["weight_codebook"]

    def layers(self, state: dict[str, torch.Tensor]) -> list[str]:
        """The layers with a ``weight_s_rel``, their tensors in the dtypes the layer holds: group
        scales stored as uint8 are fp8 bytes (ComfyUI views them so); a channel scale stored
        ``[out, 1]`` is ``[out]``."""
        layers = sorted(k.removesuffix(".weight_s_rel") for k in state if k.endswith(".weight_s_rel"))
        for name in layers:
            if state[f"{name}.weight_s_rel"].dtype == torch.uint8:
                state[f"{name}.weight_s_rel"] = state[f"{name}.weight_s_rel"].view(torch.float8_e4m3fn)
            for key in (f"{name}.weight_s_channel", f"{name}.weight_codebook"):
                if key in state:
                    state[key] = state[key].float().reshape(-1)
        return layers

    def decoded(self, state: dict[str, torch.Tensor], name: str, shape: tuple[int, int], dtype: torch.dtype
                ) -> torch.Tensor:
        """The weight comfy-kitchen decodes, its tensors taken out of ``state``."""
        codebook = state.pop(f"{name}.weight_codebook", None)
        return kitchen().dequantize_w4a8_int8_weight(
            state.pop(f"{name}.weight"), state.pop(f"{name}.weight_s_rel"), state.pop(f"{name}.weight_s_channel"),
            codebook=codebook, group_size=self.conf.group_size, convrot_groupsize=self.conf.convrot_groupsize,
            output_dtype=dtype)

    def make(self, name: str, linear: torch.nn.Linear, state: dict[str, torch.Tensor], compute: torch.dtype
             ) -> W4A8Linear:
        return W4A8Linear(linear.in_features, linear.out_features, linear.bias is not None, self.conf,
                          codebook=f"{name}.weight_codebook" in state, compute=compute, device="meta")

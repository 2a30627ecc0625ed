"""ComfyUI's W4A8 layers (comfy-kitchen's ``asym_w4a8_int8``, the form MiniMax-H3 circulates in):
int4 weights packed two per int8 byte ``[out, in / 2]``, fp8 group scales ``weight_s_rel``,
float32 channel scales ``weight_s_channel`` and an optional 16-level ``weight_codebook``, run by
comfy-kitchen's own ``w4a8_int8_linear`` (its kernels on a GPU, its eager ops elsewhere): the call
ComfyUI's quantized Linear makes, so the outputs are ComfyUI's.

Why a layer of our own rather than comfy-kitchen's ``QuantizedTensor``: a tensor subclass is what
the transports cannot move (SPEC §11); plain parameters are pinned, streamed and kept as storage
bytes by every transport with no special case. comfy-kitchen comes with ComfyUI (2026 tree); where
it is missing, a W4A8 file is refused by name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

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


@functools.cache  # looked up by every layer's forward; a failed import is not cached
def kitchen():
    """comfy-kitchen's W4A8 module, or an ImportError saying what to install."""
    try:
        from comfy_kitchen.tensor import w4a8_int8
    except ImportError as exc:
        raise ImportError("W4A8 (asym_w4a8_int8) files run through comfy-kitchen, which this Python does not have: "
                          "update ComfyUI (its requirements install comfy-kitchen) or pip install comfy-kitchen") from exc
    return w4a8_int8


class W4A8Linear(torch.nn.Module):
    """``nn.Linear``'s interface over W4A8 storage; ``compute`` is the bias's dtype; the output takes
    the input's dtype, as ComfyUI's layer gives it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, conf: W4A8Conf, codebook: bool,
                 compute: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.conf, self.compute = in_features, out_features, conf, compute

        def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        # The scales are buffers: a model's dtype is read from its first float parameter
        # (diffusers' get_parameter_dtype; MiniMax-H3 casts its inputs to it), which must not be
        # an fp8 group scale or a float32 channel scale.
        self.weight = torch.nn.Parameter(empty(out_features, in_features // 2, dtype=torch.int8), requires_grad=False)
        self.register_buffer("weight_s_rel", empty(out_features, in_features // conf.group_size,
                                                   dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_s_channel", empty(out_features, dtype=torch.float32))
        self.register_buffer("weight_codebook", empty(16, dtype=torch.float32) if codebook else None)
        self.bias = torch.nn.Parameter(empty(out_features, dtype=compute), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kitchen().w4a8_int8_linear(
            x, self.weight, self.weight_s_rel, self.weight_s_channel, codebook=self.weight_codebook,
            correction=None, bias=self.bias, group_size=self.conf.group_size,
            convrot_groupsize=self.conf.convrot_groupsize, out_dtype=x.dtype)  # ComfyUI: the input's dtype

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.conf.group_size}, convrot_groupsize={self.conf.convrot_groupsize}")


def w4a8_layers(state: dict[str, torch.Tensor]) -> list[str]:
    """The layers of a (converted) state dict stored as W4A8: those with a ``weight_s_rel``."""
    return sorted(k.removesuffix(".weight_s_rel") for k in state if k.endswith(".weight_s_rel"))


def stored_keys(layers: list[str]) -> set[str]:
    """The state-dict keys W4A8 ``layers`` hold as stored (never cast to the compute dtype)."""
    return {f"{n}.{t}" for n in layers for t in ("weight", *TENSORS)}


def swap_in(model: torch.nn.Module, layers: list[str], state: dict[str, torch.Tensor], conf: W4A8Conf,
            compute: torch.dtype) -> None:
    """Replace each named ``nn.Linear`` of ``model`` (on the meta device) by a `W4A8Linear` the
    state's tensors fit; a layer that is no Linear raises ValueError naming it."""
    for name in layers:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child, None)
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"{name} is stored as W4A8 but is a {type(linear).__name__} in "
                             f"{type(model).__name__}, not a Linear layer")
        layer = W4A8Linear(linear.in_features, linear.out_features, linear.bias is not None, conf,
                           codebook=f"{name}.weight_codebook" in state, compute=compute, device="meta")
        setattr(parent, child, layer)


def load_state(state: dict[str, torch.Tensor], layers: list[str]) -> None:
    """The layers' tensors in the dtypes the layer holds, in place: group scales stored as uint8
    are fp8 bytes (ComfyUI views them so); a channel scale stored ``[out, 1]`` is ``[out]``."""
    for name in layers:
        s_rel = state[f"{name}.weight_s_rel"]
        if s_rel.dtype == torch.uint8:
            state[f"{name}.weight_s_rel"] = s_rel.view(torch.float8_e4m3fn)
        key = f"{name}.weight_s_channel"
        if key in state:
            state[key] = state[key].float().reshape(-1)
        if f"{name}.weight_codebook" in state:
            state[f"{name}.weight_codebook"] = state[f"{name}.weight_codebook"].float()


def holds_w4a8(model: torch.nn.Module) -> bool:
    return any(isinstance(m, W4A8Linear) for m in model.modules())


def dequantize_into(state: dict[str, torch.Tensor], name: str, conf: W4A8Conf, compute: torch.dtype) -> None:
    """A W4A8 layer the model keeps in float32 (diffusers' ``_keep_in_fp32_modules``): its tensors
    in ``state`` replaced by the weight comfy-kitchen decodes in ``compute``, held in float32."""
    codebook = state.pop(f"{name}.weight_codebook", None)
    weight = kitchen().dequantize_w4a8_int8_weight(
        state.pop(f"{name}.weight"), state.pop(f"{name}.weight_s_rel"), state.pop(f"{name}.weight_s_channel"),
        codebook=codebook, group_size=conf.group_size, convrot_groupsize=conf.convrot_groupsize, output_dtype=compute)
    state[f"{name}.weight"] = weight.float()


def pop_extras(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The W4A8 layers' tensors other than the weight, taken out of a file's state dict (so that a
    key conversion sees weights only): file layer -> {"weight_s_rel": ..., ...}."""
    extras: dict[str, dict[str, torch.Tensor]] = {}
    for key in [k for k in state if k.endswith(tuple("." + t for t in TENSORS))]:
        layer, _, name = key.rpartition(".")
        extras.setdefault(layer, {})[name] = state.pop(key)
    return extras


def attach(state: dict[str, torch.Tensor], extras: dict[str, dict[str, torch.Tensor]],
           traced: dict[str, tuple[str, torch.Tensor | slice]]) -> None:
    """Put the extras back beside the converted weights: ``traced`` maps each converted layer to
    its file layer and rows (a fused weight split by the conversion takes its rows' scales; the
    codebook is the layer's, whole)."""
    for layer, (source, rows) in traced.items():
        held = extras[source]
        state[f"{layer}.weight_s_rel"] = held["weight_s_rel"][rows]
        state[f"{layer}.weight_s_channel"] = held["weight_s_channel"].reshape(-1)[rows]
        if "weight_codebook" in held:
            state[f"{layer}.weight_codebook"] = held["weight_codebook"]

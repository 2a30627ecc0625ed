"""fp8 matmul: a Linear whose weight is stored in ``float8_e4m3fn`` computes from its stored bytes
with ``torch._scaled_mm``, the input cast to fp8, as ComfyUI computes it: an unscaled weight as its
``fp8_e4m3fn_fast`` weight dtype does (`comfy/ops.py: fp8_linear`: the input clamped to ±448 and
cast with scale 1); a scaled file's weight as its quantized layers do (comfy-kitchen's
``TensorCoreFP8Layout``: the input scaled by the file's static input scale where it has one, else
per tensor by its largest magnitude), with the weight's float32 scale. The output and bias are in
the input's dtype.

Why: fp8 storage with bf16 compute can go no faster than the bf16 math (every weight cast before
its matmul); fp8 matmuls run on the fp8 tensor cores at about twice that rate and cast nothing,
at the cost of rounding activations to fp8 (an opt-in, as in ComfyUI). Where the matmul cannot
run (a GPU before sm_89, a width not a multiple of 16, an fp32 input), the layer dequantises its
weight and calls ``F.linear``, as fp8 storage does elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook

from ..formats.fp8 import Fp8Table
from . import fp8_kernel
from .cast import weight_value

FP8 = torch.float8_e4m3fn
LIMIT = 448.0  # float8_e4m3fn's largest finite value: inputs are clamped to it, as ComfyUI does
HALF = (torch.bfloat16, torch.float16)
TINY = 1e-12  # the least input scale: an all-zero input quantises to zeros, not NaN
FUSED_FROM = 1 << 25  # elements from which an eager quantise takes the one-pass kernel


@functools.cache  # asked at every eager forward of every fp8 layer
def runs_here(device: torch.device) -> bool:
    """Whether ``device`` has fp8 matmuls (the CPU has ``_scaled_mm`` too; CUDA from sm_89)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`takes` the call, on a device that has fp8 matmuls."""
    return takes(x, weight) and runs_here(x.device)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``_scaled_mm`` takes an fp8 ``e4m3fn`` weight, widths that are multiples of 16 and (with a
    bias) a bf16 or fp16 output, which is the input's dtype as in ComfyUI's layer."""
    return weight.dtype == FP8 and weight.ndim == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0 \
        and x.shape[-1] == weight.shape[1] and x.dtype in HALF


def scale_tensors(table: Fp8Table, weight: torch.Tensor, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """1, ``weight``'s scale (the file's float32 value; 1 itself where it has none) and the file's
    static input scale (None: none), float32 scalars on ``device``."""
    value, static = table.exact.get(id(weight)), table.inputs.get(id(weight))
    one = torch.ones((), dtype=torch.float32, device=device)
    return (one, one if value is None else torch.full_like(one, value),
            None if static is None else torch.full_like(one, static))


def quantise(rows: torch.Tensor, inv: torch.Tensor | None) -> torch.Tensor:
    """``(rows * inv).clamp(-448, 448)`` as ``float8_e4m3fn`` (no product without ``inv``): one
    kernel pass (`fp8_kernel.quantized`) inside a CUDA graph capture and for large inputs, torch's
    passes (the same bits) for small eager ones, where the Triton launch's host time outweighs
    the bytes it saves (bench/README.md, run 35)."""
    if rows.numel() >= FUSED_FROM or (rows.is_cuda and torch.cuda.is_current_stream_capturing()):
        fused = fp8_kernel.quantized(rows, inv)
        if fused is not None:
            return fused
    return torch_quantise(rows, inv)


def torch_quantise(rows: torch.Tensor, inv: torch.Tensor | None) -> torch.Tensor:
    """`quantise` in torch's ops (what a compiled block traces: `compiled.py`)."""
    scaled = rows if inv is None else rows * inv
    return scaled.clamp(-LIMIT, LIMIT).to(FP8)


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
                  quantiser: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] = quantise) -> torch.Tensor:
    """The fp8 matmul of ``x`` with the stored ``weight``; ``scales`` from `scale_tensors`."""
    one, scale, static = scales
    rows = x.reshape(-1, x.shape[-1])
    if scale is one and static is None:  # an unscaled weight: ComfyUI's fp8_e4m3fn_fast, the input at scale 1
        in_scale, inv = one, None
    else:  # a scaled file's weight: its layer quantises the input per tensor (comfy-kitchen's)
        in_scale = static if static is not None else (rows.abs().amax() / LIMIT).float().clamp_(min=TINY)
        inv = (1.0 / in_scale).to(rows.dtype)
    out = torch._scaled_mm(quantiser(rows, inv), weight.t(), scale_a=in_scale, scale_b=scale,
                           bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def dequantised_linear(x: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                       compute: torch.dtype) -> torch.Tensor:
    """Where the matmul cannot take the call: the layer on the weight's compute ``value``, its
    input cast to ``compute`` and its output back to the input's dtype."""
    return F.linear(x.to(compute), value, None if bias is None else bias.to(compute)).to(x.dtype)


class Fp8MatmulHook(ModelHook):
    """One fp8 Linear's forward as an fp8 matmul (under the dequantising hook's name: `dequant.py`)."""

    _diffusers_offload_hook = True  # `state.OURS`

    def __init__(self, table: Fp8Table) -> None:
        super().__init__()
        self.table = table
        self._scales: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # see `_device_scales`

    @property
    def compute_dtype(self) -> torch.dtype:
        """What diffusers' ``get_parameter_dtype`` reads from a layerwise-casting hook."""
        return self.table.compute

    def new_forward(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight, module.bias
        if not fits(x, weight):
            return dequantised_linear(x, weight_value(self.table, weight), bias, self.table.compute)
        return scaled_linear(x, weight, bias, self._device_scales(weight))

    def _device_scales(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`scale_tensors` on the weight's device, made once (an eager call comes before any
        capture: `graphs.py`)."""
        if weight.device not in self._scales:
            self._scales[weight.device] = scale_tensors(self.table, weight, weight.device)
        return self._scales[weight.device]

    def deinitalize_hook(self, module: torch.nn.Module) -> torch.nn.Module:  # diffusers' spelling
        self._scales.clear()
        return module

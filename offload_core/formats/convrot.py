"""ComfyUI's int8 "convrot" layers (comfy-kitchen's ConvRot, ``int8_tensorwise`` with
``convrot``): the file holds the int8 values, with per-row scales, of ``W·H`` taken in groups of
``g`` input columns, H being the normalised Kronecker power of comfy-kitchen's 4×4 Hadamard matrix
(symmetric and its own inverse; ``g`` a power of 4).

A stored convrot Linear computes ``(x·H) · (q·s)ᵀ``: its input rotated in groups (`RotatingLinear`),
its weight dequantised like any int8 weight (`fp8.dequantize_int8`), so the streamer's cast and
every transport stay as they are. A weight used any other way (an embedding table, a layer kept in
float32) is rotated back once at load, ``(q·s)·Hᵀ``: comfy-kitchen's own dequantisation, bit for bit.
Why the input: rotating a weight back costs 2·N·K·g flops per forward, the input 2·T·K·g (g/N of
the layer's matmul, a few percent); ComfyUI rotates the input too (then quantises it to int8).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

DEFAULT_GROUP = 256  # comfy-kitchen's default convrot_groupsize
GROUP_KEY = ".convrot_group"  # a layer's group size, carried beside its weight through key renames
_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))  # comfy-kitchen's (not Sylvester's)


def group_error(group: int, width: int) -> str | None:
    """Why ``group`` cannot rotate rows of ``width`` (None: it can)."""
    if group < 4 or group & (group - 1) or (group.bit_length() - 1) % 2:
        return f"its convrot group size {group} is not a power of 4"
    if width % group:
        return f"its input width {width} is not a multiple of its convrot group size {group}"
    return None


@functools.cache
def _hadamard(group: int) -> torch.Tensor:
    """The normalised group × group matrix in float32 (its entries ±2^-k: exact in every float dtype)."""
    h4 = torch.tensor(_H4, dtype=torch.float32)
    h = h4
    while h.shape[0] < group:
        h = torch.kron(h, h4)
    return h / group**0.5


def hadamard(group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _on(group, dtype, torch.device(device))


@functools.cache
def _on(group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _hadamard(group).to(dtype=dtype, device=device)


def rotate_input(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x·H`` in groups of its last dimension, in ``x``'s dtype (ComfyUI's activation rotation)."""
    return rotate_with(x, hadamard(group, x.dtype, x.device))


def rotate_with(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """`rotate_input` with its matrix given (a compiled twin holds it as a buffer)."""
    group = h.shape[0]
    return (x.reshape(-1, x.shape[-1] // group, group) @ h.to(x.dtype)).reshape(x.shape)


def rotate_back(weight: torch.Tensor, group: int) -> torch.Tensor:
    """A dequantised (float32) weight ``q·s`` in its original basis, ``(q·s)·Hᵀ`` in groups of its
    columns: the bits of comfy-kitchen's ``dequantize_int8_convrot_weight``."""
    rows, width = weight.shape
    h = hadamard(group, weight.dtype, weight.device)
    return (weight.reshape(rows, width // group, group) @ h.T).reshape(rows, width)


class RotatingLinear(torch.nn.Linear):
    """A Linear whose stored weight is a convrot one: its input is rotated first (``convrot_group``
    columns at a time); the weight it computes with is whatever the transport binds (the int8
    weight's compute value). A plain Linear's class is swapped for this one (`rotate_inputs`),
    so its parameters, hooks and name stay."""

    convrot_group: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rotated(self, x), self.weight, self.bias)


def rotated(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``layer`` computes from it: rotated if it is a `RotatingLinear` (with the matrix a
    compiled twin holds as its ``convrot_h`` buffer, made before any capture: a graph cannot copy
    it in), else as it is."""
    group = group_of(layer)
    if not group:
        return x
    h = layer._buffers.get("convrot_h")
    return rotate_input(x, group) if h is None else rotate_with(x, h)


def rotate_inputs(layer: torch.nn.Linear, group: int, what: str) -> None:
    """Make ``layer`` (a plain ``nn.Linear``) rotate its input in groups of ``group``."""
    if type(layer) is not torch.nn.Linear:
        raise ValueError(f"{what}: a convrot weight on a {type(layer).__name__}, not a plain Linear")
    why = group_error(group, layer.in_features)
    if why is not None:
        raise ValueError(f"{what}: {why}")
    layer.__class__ = RotatingLinear
    layer.convrot_group = group


def group_of(module: torch.nn.Module) -> int:
    """The layer's convrot group size, 0 for a layer that does not rotate its input."""
    return getattr(module, "convrot_group", 0) if isinstance(module, RotatingLinear) else 0

"""fp8 storage with bf16/fp16 compute: which weights of a model are stored in fp8, their per-tensor
scales, and the one dequantisation every path uses (``weight.to(compute) * scale.to(compute)``,
as ComfyUI's fp8 "scaled" layers compute it).

Only ``nn.Linear`` weights are stored in fp8 (they are nearly all of a denoiser's bytes), and not
in the layers diffusers' own layerwise casting skips (embeddings, norms, ``proj_out``: their dtype
steers input casts, e.g. Wan's time embedder casts the timestep to its weight's dtype); any other
fp8 tensor a file holds is dequantised once at marking.
The table lives on the model under one key (`FP8`); it is the weights' format, set by the
loader, so a release keeps it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

from ..components import denoisers
from ..log import get_logger
from ..state import FP8

log = get_logger("fp8")

FP8_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class Fp8Table:
    """A model's fp8 weights: ``compute`` is what they are dequantised to; ``scales`` maps
    ``id(weight)`` to its per-tensor scale (absent: 1)."""

    storage: torch.dtype
    compute: torch.dtype
    weights: dict[int, str] = field(default_factory=dict)  # id(weight) -> its layer's name
    scales: dict[int, float] = field(default_factory=dict)

    def scale_of(self, weight: torch.Tensor) -> float | None:
        return self.scales.get(id(weight))

    def holds(self, weight: torch.Tensor) -> bool:
        return id(weight) in self.weights and weight.dtype == self.storage


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES.values()


def table_of(model: torch.nn.Module) -> Fp8Table | None:
    return FP8.get(model)


def dequantize(weight: torch.Tensor, scale: float | None, compute: torch.dtype) -> torch.Tensor:
    """The compute-dtype value of an fp8 weight; ``scale`` as `scale_value` rounds it (the product
    is then computed in float and rounded once, the bits of ``w.to(c) * scale.to(c)``)."""
    out = weight.to(compute)
    return out if scale is None else out.mul_(scale)


def store_fp8(model: torch.nn.Module, storage: torch.dtype, compute: torch.dtype) -> Fp8Table:
    """Cast the model's Linear weights to ``storage`` in place (what ComfyUI's UNETLoader
    ``weight_dtype`` does), computing in ``compute``."""
    _check_dtypes(storage, compute, type(model).__name__)
    for _name, layer in _linears(model):
        if layer.weight.is_floating_point() and not is_fp8(layer.weight):
            layer.weight.data = layer.weight.data.to(storage)
    return mark_fp8(model, compute)


def store_denoisers_fp8(pipe: object, storage: torch.dtype, compute: torch.dtype) -> list[str]:
    """`store_fp8` on each of the pipeline's denoisers; returns their names."""
    found = denoisers(pipe)
    for module in found.values():
        store_fp8(module, storage, compute)
    return list(found)


def mark_fp8(model: torch.nn.Module, compute: torch.dtype, scales: dict[str, torch.Tensor] | None = None,
             source: str | None = None) -> Fp8Table:
    """Record the model's fp8 Linear weights and their per-tensor ``scales`` (by layer name, as
    a file's ``<layer>.scale_weight`` / ``<layer>.weight_scale`` names them); any other fp8
    tensor is dequantised now. ``source`` names the file in errors."""
    what = source or type(model).__name__
    scales = dict(scales or {})
    linears = dict(_linears(model))
    storages = {layer.weight.dtype for layer in linears.values() if is_fp8(layer.weight)}
    if len(storages) > 1:
        raise ValueError(f"{what}: mixes fp8 formats {sorted(map(str, storages))}; one fp8 dtype per model")
    storage = storages.pop() if storages else torch.float8_e4m3fn
    _check_dtypes(storage, compute, what)
    table = Fp8Table(storage, compute)
    for name, layer in linears.items():
        scale = scales.pop(name, None)
        if not is_fp8(layer.weight):
            if scale is not None:
                raise ValueError(f"{what}: {name} has a weight scale but its weight is {layer.weight.dtype}, not fp8")
            continue
        table.weights[id(layer.weight)] = name
        if scale is not None:
            table.scales[id(layer.weight)] = _scalar(scale, name, layer.weight, what, compute)
    _dequantize_others(model, compute, scales, what)
    if scales:
        raise ValueError(f"{what}: scales for layers the model does not have: {sorted(scales)[:5]}")
    FP8.set(model, table)
    log.info("%s: %d Linear weights stored in %s (%d scaled), computing in %s", what, len(table.weights),
             str(storage).removeprefix("torch."), len(table.scales), str(compute).removeprefix("torch."))
    return table


def _dequantize_others(model: torch.nn.Module, compute: torch.dtype, scales: dict[str, torch.Tensor],
                       what: str) -> None:
    """fp8 tensors outside Linear weights (a conv, a norm, a bias) become compute-dtype values."""
    stored = {id(layer) for _name, layer in _linears(model)}
    for name, module in model.named_modules():
        for pname, t in (*module._parameters.items(), *module._buffers.items()):
            if t is None or not is_fp8(t) or (pname == "weight" and id(module) in stored):
                continue
            scale = scales.pop(name, None) if pname == "weight" else None
            t.data = dequantize(t.data, None if scale is None else _scalar(scale, name, t, what, compute), compute)


def scale_value(scale: torch.Tensor | float, compute: torch.dtype) -> float:
    """A per-tensor scale rounded to ``compute``, as ``dequantize`` takes it."""
    return float(torch.as_tensor(scale, dtype=torch.float32).reshape(()).to(compute).float().item())


def _scalar(scale: torch.Tensor | float, layer: str, weight: torch.Tensor, what: str, compute: torch.dtype) -> float:
    """The per-tensor scale as the compute dtype holds it: ComfyUI dequantises with
    ``w.to(c) * scale.to(c)`` (comfy-kitchen's reference), so the scale is rounded to ``c`` first."""
    if isinstance(scale, torch.Tensor) and scale.numel() != 1:
        raise ValueError(
            f"{what}: the scale of {layer} has shape {tuple(scale.shape)} for a weight of shape "
            f"{tuple(weight.shape)}; only per-tensor scales (one value) are supported")
    value = scale_value(scale, compute)
    if not (value == value and abs(value) != float("inf")):  # nan / inf
        raise ValueError(f"{what}: the scale of {layer} is {value}")
    return value


def _check_dtypes(storage: torch.dtype, compute: torch.dtype, what: str) -> None:
    if storage not in FP8_DTYPES.values():
        raise ValueError(f"{what}: {storage} is not an fp8 storage dtype (one of {list(FP8_DTYPES)})")
    if compute not in COMPUTE_DTYPES:
        raise ValueError(f"{what}: fp8 weights compute in bf16, fp16 or fp32, not {compute}")


def _linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The Linear layers that may store fp8: diffusers' layerwise-casting skip patterns apply, and
    so do the model's ``_keep_in_fp32_modules``, as in its ``enable_layerwise_casting``."""
    skip = (*DEFAULT_SKIP_MODULES_PATTERN, *(getattr(model, "_skip_layerwise_casting_patterns", None) or ()),
            *(getattr(model, "_keep_in_fp32_modules", None) or ()))
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and isinstance(getattr(m, "weight", None), torch.Tensor)
            and not any(re.search(pattern, n) for pattern in skip)]

"""Low-precision storage with bf16/fp16 compute: which weights of a model are stored in fp8 (or in
int8, from ComfyUI's ``int8_tensorwise`` files), their scales, and the one dequantisation every
path uses per storage: fp8 ``weight.to(compute) * scale.to(compute)``, as ComfyUI's fp8 "scaled"
layers compute it; int8 ``(q.float() * scale).to(compute)``, comfy-kitchen's
``dequantize_int8_simple_dtype`` (a float32 product rounded once; per-tensor or per-row scales).

Only ``nn.Linear`` weights are stored in fp8 (they are nearly all of a denoiser's bytes), and not
in the layers diffusers' own layerwise casting skips (embeddings, norms, ``proj_out``: their dtype
steers input casts, e.g. Wan's time embedder casts the timestep to its weight's dtype); any other
fp8 tensor a file holds (and any scaled int8 weight outside them) is dequantised once at marking.
The table lives on the model under one key (`FP8`); it is the weights' format, set by the
loader, so a release keeps it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

from ..log import get_logger
from ..state import FP8
from .convrot import rotate_back, rotate_inputs
from .stored_linear import StoredLinear

log = get_logger("fp8")

SCALE_KEY = ".scale_weight"  # the spelling both ComfyUI layouts are normalised to before conversion
INPUT_KEY = ".scale_input"  # the same for static input scales
FP8_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INT8 = torch.int8  # ComfyUI's int8_tensorwise weights
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def popped(state: dict[str, torch.Tensor], suffix: str) -> dict[str, torch.Tensor]:
    """The ``<layer><suffix>`` tensors (``SCALE_KEY``, ``INPUT_KEY``, ...) taken out of ``state``, by layer."""
    return {k.removesuffix(suffix): state.pop(k) for k in [k for k in state if k.endswith(suffix)]}


@dataclass
class Fp8Table:
    """A model's stored weights: fp8, or int8 when ``storage`` is `INT8` (the name predates int8;
    one storage dtype per model). ``compute`` is what they are dequantised to; ``scales`` maps
    ``id(weight)`` of an fp8 weight to its per-tensor scale (absent: 1), ``int8_scales`` that of
    an int8 weight to its float scale tensor (shape ``()`` or ``[rows, 1]``)."""

    storage: torch.dtype
    compute: torch.dtype
    matmul: bool = False  # fp8 matmuls from the stored bytes, no cast (`transport/fp8_matmul.py`)
    weights: dict[int, str] = field(default_factory=dict)  # id(weight) -> its layer's name
    scales: dict[int, float] = field(default_factory=dict)
    exact: dict[int, float] = field(default_factory=dict)  # the same scales in float32, as fp8 matmuls take them
    inputs: dict[int, float] = field(default_factory=dict)  # a file's static input scales (float32), for fp8 matmuls
    matmul_off: str = ""  # why this model's fp8 matmuls stay off (its file asks for full-precision matmuls)
    int8_scales: dict[int, torch.Tensor] = field(default_factory=dict)
    _on_device: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def int8(self) -> bool:
        return self.storage == INT8

    def int8_scale(self, weight: torch.Tensor, device: torch.device) -> torch.Tensor:
        """An int8 weight's scale on ``device`` (copied there once)."""
        key = (id(weight), device)
        if key not in self._on_device:
            self._on_device[key] = self.int8_scales[id(weight)].to(device)
        return self._on_device[key]

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


def dequantize_int8(
    q: torch.Tensor, scale: torch.Tensor, compute: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The compute-dtype value of an int8 weight: the bits of ``(q.float() * scale).to(compute)``
    (int8 to float is exact, the product is float32 and rounded once into ``out``), without a
    float32 copy of the weight."""
    if out is None:
        out = torch.empty(q.shape, dtype=compute, device=q.device)
    return torch.mul(q, scale, out=out)


def decode_int8(q: torch.Tensor, scale: torch.Tensor, compute: torch.dtype, group: int = 0) -> torch.Tensor:
    """An int8 weight's value in its own basis, for a use other than a stored Linear's matmul:
    `dequantize_int8`, or for a convrot weight (``group``: its group size) the float32 product
    rotated back and rounded once (`convrot.rotate_back`)."""
    return rotate_back(q.float() * scale, group).to(compute) if group else dequantize_int8(q, scale, compute)


def store_fp8(model: torch.nn.Module, storage: torch.dtype, compute: torch.dtype,
              matmul: bool = False) -> Fp8Table | None:
    """Cast the model's Linear weights to ``storage`` in place (what ComfyUI's UNETLoader
    ``weight_dtype`` does), computing in ``compute`` (``matmul``: fp8 matmuls, its ``_fast``).
    A model a file already stored (its table made, scales and all) keeps its weights, and one
    another quantizer made is left alone (None)."""
    what = type(model).__name__
    _check_dtypes(storage, compute, what)
    table = table_of(model)
    if table is not None:
        return _with_matmul(table, what) if matmul else table
    if getattr(model, "hf_quantizer", None) is not None:
        log.info("%s: quantized by %s, not stored in fp8", what, type(model.hf_quantizer).__name__)
        return None
    for _name, layer in _linears(model):
        if layer.weight.is_floating_point() and not is_fp8(layer.weight):
            layer.weight.data = layer.weight.data.to(storage)
    return mark_fp8(model, compute, matmul=matmul)


def _with_matmul(table: Fp8Table, what: str) -> Fp8Table:
    """A stored model's table computing through fp8 matmuls, where its storage is ``e4m3fn`` and
    its file does not ask for full-precision matmuls."""
    if table.matmul_off:
        log.info("%s: %s: computing in %s, not through fp8 matmuls", what, table.matmul_off,
                 str(table.compute).removeprefix("torch."))
    elif table.storage != torch.float8_e4m3fn:
        log.info("%s: stored in %s, which fp8 matmuls do not take: computing in %s", what,
                 str(table.storage).removeprefix("torch."), str(table.compute).removeprefix("torch."))
    elif not table.matmul:
        table.matmul = True
        log.info("%s: its float8_e4m3fn weights compute through fp8 matmuls (inputs rounded to fp8%s)", what,
                 f"; {len(table.inputs)} at the file's input scales" if table.inputs else "")
    return table


def mark_fp8(
    model: torch.nn.Module,
    compute: torch.dtype,
    scales: dict[str, torch.Tensor] | None = None,
    source: str | None = None,
    matmul: bool = False,
    input_scales: dict[str, torch.Tensor] | None = None,
    matmul_off: str = "",
    convrot: dict[str, int] | None = None,
) -> Fp8Table:
    """Record the model's fp8 (or int8) Linear weights and their ``scales`` (by layer name, as a
    file's ``<layer>.scale_weight`` / ``<layer>.weight_scale`` names them: per tensor for fp8, per
    tensor or per row for int8, which needs one); any other fp8 tensor, and any scaled int8 weight
    outside those layers, is dequantised now. ``source`` names the file in errors; ``matmul``:
    ``float8_e4m3fn`` weights compute as fp8 matmuls (refused for another storage), each input
    quantised at its layer's ``input_scales`` value where the file has one (ComfyUI's static
    ``input_scale``); ``matmul_off`` says why a file keeps them off."""
    what = source or type(model).__name__
    scales, convrot = dict(scales or {}), dict(convrot or {})
    linears = dict(_linears(model))
    inputs = _input_scales(input_scales or {}, model, what)
    storage = _one_storage(linears, compute, matmul, what)
    table = Fp8Table(storage, compute, matmul_off=matmul_off)
    for name, layer in linears.items():
        scale = scales.pop(name, None)
        if not _stored(layer.weight):
            if scale is not None:
                raise ValueError(
                    f"{what}: {name} has a weight scale but its weight is {layer.weight.dtype}, not fp8"
                )
            continue
        table.weights[id(layer.weight)] = name
        if layer.weight.dtype == INT8:
            table.int8_scales[id(layer.weight)] = check_int8_scale(scale, name, layer.weight, what)
            if name in convrot:
                rotate_inputs(layer, convrot.pop(name), f"{what}: {name}")
        elif scale is not None:
            table.scales[id(layer.weight)] = _scalar(scale, name, layer.weight, what, compute)
            table.exact[id(layer.weight)] = float(torch.as_tensor(scale, dtype=torch.float32).reshape(()))
        if name in inputs and layer.weight.dtype == torch.float8_e4m3fn:
            table.inputs[id(layer.weight)] = inputs[name]
    _dequantize_others(model, compute, scales, what, convrot)
    if scales or convrot:
        raise ValueError(f"{what}: scales or convrot groups for layers the model does not hold as int8 or fp8 "
                         f"weights: {sorted({*scales, *convrot})[:5]}")
    FP8.set(model, table)
    if table.int8:
        _log_int8(what, table)
    else:
        log.info("%s: %d Linear weights stored in %s (%d scaled), computing in %s", what, len(table.weights),
                 str(storage).removeprefix("torch."), len(table.scales), str(compute).removeprefix("torch."))
    return _with_matmul(table, what) if matmul else table


def _one_storage(linears: dict[str, torch.nn.Linear], compute: torch.dtype, matmul: bool, what: str) -> torch.dtype:
    """The one stored dtype of the model's fp8 / int8 Linear weights (float8_e4m3fn where none is):
    a model mixing them, or fp8 matmuls asked of another storage than float8_e4m3fn, is refused."""
    storages = {layer.weight.dtype for layer in linears.values() if _stored(layer.weight)}
    if len(storages) > 1 and INT8 in storages:
        raise ValueError(
            f"{what}: mixes int8 and fp8 weights {sorted(map(str, storages))}; one storage dtype per model"
        )
    if len(storages) > 1:
        raise ValueError(f"{what}: mixes fp8 formats {sorted(map(str, storages))}; one fp8 dtype per model")
    storage = storages.pop() if storages else torch.float8_e4m3fn
    _check_dtypes(storage, compute, what, int8=True)
    if matmul and storage != torch.float8_e4m3fn:
        raise ValueError(f"{what}: fp8 matmuls take float8_e4m3fn weights, not {str(storage).removeprefix('torch.')}")
    return storage


def _input_scales(input_scales: dict[str, torch.Tensor], model: torch.nn.Module, what: str) -> dict[str, float]:
    """A file's static input scales by layer, as float32 values (unused on layers that dequantise);
    refused by name where one is not a single finite positive value or names no layer of the model."""
    unknown = sorted(set(input_scales) - {n for n, _m in model.named_modules()})
    if unknown:
        raise ValueError(f"{what}: input scales for layers the model does not have: {unknown[:5]}")
    values = {}
    for name, scale in input_scales.items():
        scale = torch.as_tensor(scale, dtype=torch.float32)
        value = float(scale.reshape(())) if scale.numel() == 1 else None
        if value is None or not (0 < value < float("inf")):
            raise ValueError(f"{what}: the input scale of {name} is {scale.tolist()}; one finite positive value "
                             "per layer is supported")
        values[name] = value
    return values


def _log_int8(what: str, table: Fp8Table) -> None:
    rows = sum(s.ndim > 0 for s in table.int8_scales.values())
    log.info(
        "%s: %d Linear weights stored in int8 (ComfyUI int8_tensorwise: %d per-row, %d per-tensor scales), "
        "computing in %s, cast as (q.float() * scale).to(compute) by the int8 kernel on a CUDA card "
        "(by torch elsewhere)",
        what,
        len(table.weights),
        rows,
        len(table.weights) - rows,
        str(table.compute).removeprefix("torch."),
    )


def _stored(t: torch.Tensor) -> bool:
    return is_fp8(t) or t.dtype == INT8


def _dequantize_others(
    model: torch.nn.Module, compute: torch.dtype, scales: dict[str, torch.Tensor], what: str,
    convrot: dict[str, int],
) -> None:
    """fp8 tensors outside Linear weights (a conv, a norm, a bias) become compute-dtype values, and
    so do int8 weights there (they need their scale; a convrot one is rotated back); stored layers
    (W4A8, W4A4, NVFP4, MXFP8) keep theirs (fp8 scales)."""
    stored = {id(layer) for _name, layer in _linears(model)}
    for name, module in model.named_modules():
        if isinstance(module, StoredLinear):
            continue
        for pname, t in (*module._parameters.items(), *module._buffers.items()):
            if t is None or (pname == "weight" and id(module) in stored):
                continue
            if pname == "weight" and t.dtype == INT8:
                scale = check_int8_scale(scales.pop(name, None), name, t, what)
                t.data = decode_int8(t.data, scale, compute, convrot.pop(name, 0))
                continue
            if not is_fp8(t):
                continue
            scale = scales.pop(name, None) if pname == "weight" else None
            t.data = dequantize(
                t.data, None if scale is None else _scalar(scale, name, t, what, compute), compute
            )


def check_int8_scale(scale: torch.Tensor | None, layer: str, weight: torch.Tensor, what: str) -> torch.Tensor:
    """An int8 weight's scale as `dequantize_int8` takes it: one value (shape ``()``) or one per
    row (``[rows, 1]``), in the dtype of ComfyUI's ``q.float() * scale`` (float32 but for a
    float64 per-row scale)."""
    if scale is None:
        raise ValueError(f"{what}: {layer} has an int8 weight without a weight scale")
    scale = torch.as_tensor(scale)
    rows = weight.shape[0] if weight.ndim else 1
    if not scale.is_floating_point() or (scale.numel() != 1 and tuple(scale.shape) != (rows, 1)):
        raise ValueError(
            f"{what}: the scale of {layer} has shape {tuple(scale.shape)} ({scale.dtype}) for an int8 weight of "
            f"shape {tuple(weight.shape)}; int8 scales are float, per tensor (one value) or per row ([{rows}, 1])"
        )
    if not torch.isfinite(scale).all():
        raise ValueError(f"{what}: the scale of {layer} is not finite")
    dtype = torch.result_type(torch.empty(1, device="meta"), scale)
    return (scale.reshape(()) if scale.numel() == 1 else scale).to(dtype).contiguous()


def scale_value(scale: torch.Tensor | float, compute: torch.dtype) -> float:
    """A per-tensor scale rounded to ``compute``, as ``dequantize`` takes it."""
    return float(torch.as_tensor(scale, dtype=torch.float32).reshape(()).to(compute).float().item())


def _scalar(
    scale: torch.Tensor | float, layer: str, weight: torch.Tensor, what: str, compute: torch.dtype
) -> float:
    """The per-tensor scale as the compute dtype holds it: ComfyUI dequantises with
    ``w.to(c) * scale.to(c)`` (comfy-kitchen's reference), so the scale is rounded to ``c`` first."""
    if isinstance(scale, torch.Tensor) and scale.numel() != 1:
        raise ValueError(
            f"{what}: the scale of {layer} has shape {tuple(scale.shape)} for a weight of shape "
            f"{tuple(weight.shape)}; only per-tensor scales (one value) are supported"
        )
    value = scale_value(scale, compute)
    if not (value == value and abs(value) != float("inf")):  # nan / inf
        raise ValueError(f"{what}: the scale of {layer} is {value}")
    return value


def _check_dtypes(storage: torch.dtype, compute: torch.dtype, what: str, int8: bool = False) -> None:
    """``int8``: a loader's int8 weights are accepted too (never a cast to int8)."""
    if storage not in FP8_DTYPES.values() and not (int8 and storage == INT8):
        raise ValueError(f"{what}: {storage} is not an fp8 storage dtype (one of {list(FP8_DTYPES)})")
    if compute not in COMPUTE_DTYPES:
        kind = "int8" if storage == INT8 else "fp8"
        raise ValueError(f"{what}: {kind} weights compute in bf16, fp16 or fp32, not {compute}")


def _linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The Linear layers that may store fp8: diffusers' layerwise-casting skip patterns apply, and
    so do the model's ``_keep_in_fp32_modules``, as in its ``enable_layerwise_casting``."""
    skip = (
        *DEFAULT_SKIP_MODULES_PATTERN,
        *(getattr(model, "_skip_layerwise_casting_patterns", None) or ()),
        *(getattr(model, "_keep_in_fp32_modules", None) or ()),
    )
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and not any(re.search(pattern, n) for pattern in skip)
    ]

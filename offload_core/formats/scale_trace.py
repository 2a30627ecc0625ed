"""What a quantized layer carries beside its weight (scales, W4A8 row tensors, a convrot group)
through a diffusers single-file conversion that renames, drops, splits or reorders weights.

diffusers' Flux conversion builds a new dict (a file's ``<layer>.scale_weight`` keys are not in it)
and splits fused weights (BFL's ``qkv``, ``linear1``) that carry one scale; its H3 conversion
splits ``qkv_proj`` and swaps the gated feed-forward's row halves. Why not a table of renames per
family: the conversion already knows them; running it once more on a probe, one float64 value per
row that names its file layer and row, tells where every converted weight came from, so a
per-tensor scale goes to each split part and a per-row scale follows its rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from .inspect import SingleFileError

PROBE_ROWS = 2**24  # a probe value's row part (a weight has fewer rows); its layer number above it


def follow_rows(traced: dict[str, tuple[str, torch.Tensor | slice]], values: dict[str, torch.Tensor],
                shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Converted layer -> its scale, for the file layers of ``values`` (by layer name), along
    ``traced`` (`trace_rows`): a per-tensor scale goes to each part, a per-row one follows its rows;
    a scale of another shape goes on whole (the checks downstream name it)."""
    out = {}
    for key, (layer, rows) in traced.items():
        if layer in values:
            scale = values[layer]
            rows_held = shapes.get(f"{layer}.weight", (0,))[0]
            per_row = scale.numel() > 1 and scale.ndim > 0 and scale.shape[0] == rows_held
            out[key] = scale[rows] if per_row else scale
    return out


def trace_rows(path: Path, cls: type, convert: Callable[..., dict], config: dict, shapes: dict[str, tuple[int, ...]],
               layers: list[str], what: str) -> dict[str, tuple[str, torch.Tensor]]:
    """Converted layer -> (the file layer its weight came from, which of that weight's rows, in
    order), for the file ``layers`` of a file whose weights have ``shapes``. Refused by name
    (``what`` says what is traced) when a converted weight mixes layers or a layer reaches none."""
    if not layers:
        return {}
    number = {layer + ".weight": i for i, layer in enumerate(layers)}
    probe = {}
    for key, shape in shapes.items():
        rows = torch.arange(shape[0], dtype=torch.float64) if shape else torch.zeros((), dtype=torch.float64)
        probe[key] = rows + (number[key] + 1) * PROBE_ROWS if key in number else torch.full_like(rows, -1.0)
    cannot = (f"{path}: diffusers' {cls.__name__} conversion does not keep the file's {len(layers)} {what} "
              "and they cannot be traced through it")
    try:
        converted = convert(config=config, checkpoint=probe)
    except Exception as exc:  # the conversion's own error, named with the file
        raise SingleFileError(f"{cannot} ({type(exc).__name__}: {exc})") from exc
    traced: dict[str, tuple[str, torch.Tensor]] = {}
    for key, values in converted.items():
        if not key.endswith(".weight") or values.ndim != 1 or bool((values < 0).all()):
            continue
        ids = torch.div(values, PROBE_ROWS, rounding_mode="floor").long() - 1
        if bool((ids != ids[0]).any()) or int(ids[0]) < 0:
            raise SingleFileError(f"{cannot}: {key} mixes weights of different layers")
        rows = (values - (int(ids[0]) + 1) * PROBE_ROWS).long()
        traced[key.removesuffix(".weight")] = (layers[int(ids[0])], rows)
    missing = sorted(set(layers) - {layer for layer, _rows in traced.values()})
    if missing:
        raise SingleFileError(f"{cannot}: {missing[:3]} reach no layer")
    return traced

"""Weight scales (and W4A8 layers' row tensors) through a diffusers single-file conversion that
drops or splits them.

diffusers' Flux conversion builds a new dict (a file's ``<layer>.scale_weight`` keys are not in it)
and splits fused weights (BFL's ``qkv``, ``linear1``) that carry one scale. Why not a table of
renames per family: the conversion already knows them; running it once more on a probe, one
float64 value per row that names its file layer and row, tells where every converted weight came
from, so a per-tensor scale goes to each split part and a per-row scale follows its rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from .inspect import SingleFileError

PROBE_ROWS = 2**24  # a probe value's row part (a weight has fewer rows); its layer number above it


def trace_scales(path: Path, cls: type, convert: Callable[..., dict], config: dict,
                 shapes: dict[str, tuple[int, ...]], file_scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Converted layer -> its scale, for the file layers ``file_scales`` (by layer name), through
    ``convert(config=, checkpoint=)``: a per-tensor scale goes to each part, a per-row one follows
    its rows (see `trace_rows`)."""
    traced = trace_rows(path, cls, convert, config, shapes, sorted(file_scales), "weight scales")
    scales = {}
    for key, (layer, rows) in traced.items():
        scale = file_scales[layer]
        per_row = scale.numel() > 1 and scale.ndim > 0 and scale.shape[0] == shapes[f"{layer}.weight"][0]
        scales[key] = scale[rows] if per_row else scale  # (another shape goes on whole: the checks name it)
    return scales


def trace_rows(path: Path, cls: type, convert: Callable[..., dict], config: dict, shapes: dict[str, tuple[int, ...]],
               layers: list[str], what: str) -> dict[str, tuple[str, torch.Tensor]]:
    """Converted layer -> (the file layer its weight came from, which of that weight's rows, in
    order), for the file ``layers`` of a file whose weights have ``shapes``. Refused by name
    (``what`` says what is traced) when a converted weight mixes layers or a layer reaches none."""
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

"""Block scales in cuBLAS's tiled ("swizzled") layout, as comfy-kitchen stores NVFP4's and MXFP8's:
tiles of 128 rows by 4 blocks, the matrix padded to whole tiles. A fused layer diffusers splits by
rows needs each part's rows of them, tiled again for comfy-kitchen's decode.
"""

from __future__ import annotations

import torch


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def tiled_shape(rows: int, blocks: int) -> tuple[int, int]:
    """The stored shape of the tiled scales of ``rows`` rows of ``blocks`` blocks."""
    return round_up(rows, 128), round_up(blocks, 4)


def rows_of(tiled: torch.Tensor, rows: torch.Tensor | slice, count: int) -> torch.Tensor:
    """The tiled scales of weight ``rows`` (of a weight of ``count`` rows): ``tiled`` itself for all
    of them in order, else untiled whole (padding included), taken and tiled again."""
    if isinstance(rows, slice) and rows == slice(None):
        return tiled
    if isinstance(rows, torch.Tensor) and rows.numel() == count and torch.equal(rows, torch.arange(count)):
        return tiled
    from comfy_kitchen.float_utils import from_blocked, to_blocked

    return to_blocked(from_blocked(tiled, *tiled.shape)[rows], flatten=False)

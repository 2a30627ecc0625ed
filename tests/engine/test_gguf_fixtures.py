"""The hand-packed K-quant blocks of tests/fixtures/gguf_files.py are what the format says.

The gguf package cannot quantize K-quants, so the fixtures pack Q4_K/Q5_K/Q6_K blocks themselves;
a wrong bit layout would still load and run, only with wrong weights. So: the gguf package's numpy
dequantizer (a port of llama.cpp's dequantize_row_q*_K) reads every value back within half of its
sub-block's step, the steps the blocks store are tight (the format's step for that sub-block's
values, not a loose one that would hide a wrong layout), and diffusers' torch dequantizer (what
`GGUFLinear` runs) reads the same values.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from diffusers.quantizers.gguf.utils import dequantize_functions
from fixtures.gguf_files import K_QUANTS

T = gguf.GGMLQuantizationType
LEVELS = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 31}  # codes above the sub-block's minimum (Q6_K: 31 each side of 0)


def _rows() -> np.ndarray:
    """Rows of 512 with scales from 0.01 to 1, a sub-block of positive values only (its minimum is
    then 0) and an all-zero K block."""
    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((8, 512)) * rng.uniform(0.01, 1.0, (8, 1))).astype(np.float32)
    rows[0, :32] = np.abs(rows[0, :32]) + 0.5
    rows[1, :256] = 0.0
    return rows


def _stored(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per value: the block's `d`, its sub-block's integer scale `sc` (its step is d * sc) and the
    block's `dmin` (0 for Q6_K), read from the bytes at the offsets llama.cpp's block structs give."""
    if qtype == "Q6_K":
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
        sc = np.repeat(blocks[:, 192:208].copy().view(np.int8).astype(np.float32), 16, axis=1)
        return np.broadcast_to(d, sc.shape), sc, np.zeros_like(sc)
    d, dmin = (blocks[:, i : i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
    sc, _m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    sc = np.repeat(sc.astype(np.float32), 32, axis=1)
    return np.broadcast_to(d, sc.shape), sc, np.broadcast_to(dmin, sc.shape)


def _tight_steps(rows: np.ndarray, qtype: str) -> np.ndarray:
    """Per value: the smallest step that covers its sub-block's values with the format's codes."""
    if qtype == "Q6_K":
        sub = np.abs(rows.reshape(-1, 16)).max(axis=-1) / LEVELS[qtype]
        return np.repeat(sub, 16).reshape(-1, 256)
    sub = rows.reshape(-1, 32)
    spread = (sub.max(axis=-1) - np.minimum(sub.min(axis=-1), 0)) / LEVELS[qtype]
    return np.repeat(spread, 32).reshape(-1, 256)


@pytest.mark.parametrize("qtype", list(K_QUANTS))
def test_gguf_reads_packed_k_blocks_back_within_half_a_step(qtype):
    rows = _rows()
    packed = K_QUANTS[qtype][0](rows)
    _block, type_size = gguf.GGML_QUANT_SIZES[T[qtype]]
    assert packed.dtype == np.uint8 and packed.shape == (8, 2 * type_size)
    values = gguf.quants.dequantize(packed, T[qtype])
    assert values.shape == rows.shape
    d, sc, dmin = _stored(packed.reshape(-1, type_size), qtype)
    step, err = d * sc, np.abs(values - rows).reshape(-1, 256)
    # Half a step; a Q4_K/Q5_K value at its sub-block's ends is also off by the rounding of the
    # stored minimum (dmin * m, m an integer), at most half of dmin.
    assert (err <= np.maximum(step, dmin) / 2 * (1 + 1e-5) + 1e-7).all(), f"{qtype}: worst {err.max():.4g}"
    # The stored step is the format's: it covers the sub-block (no code clips) and exceeds the
    # smallest one that does by less than one `d` (the scale is an integer multiple of `d`).
    tight = _tight_steps(rows, qtype)
    assert (step >= tight * (1 - 1e-3)).all() and (step <= tight + d * (1 + 1e-3)).all()


@pytest.mark.parametrize("qtype", list(K_QUANTS))
def test_diffusers_torch_dequantizer_reads_the_same_values(qtype):
    rows = _rows()
    packed = K_QUANTS[qtype][0](rows)
    block, type_size = gguf.GGML_QUANT_SIZES[T[qtype]]
    want = torch.from_numpy(gguf.quants.dequantize(packed, T[qtype]))
    blocks = torch.from_numpy(packed.reshape(-1, type_size).copy())
    dequantize = dequantize_functions[T[qtype]]
    exact = dequantize(blocks, block, type_size, dtype=torch.float32).reshape(rows.shape)
    assert torch.equal(exact, want), "float32: the same arithmetic, the same values"
    half = dequantize(blocks, block, type_size).reshape(rows.shape)  # GGUFLinear's path: fp16 scales
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), want, rtol=0, atol=2e-3 * float(np.abs(rows).max()))


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_iq4_blocks_hold_each_values_nearest_table_entry(qtype):
    """The hand-packed IQ4 blocks (`fixtures/gguf_iq4.py`): gguf's dequantizer reads each value as
    the table entry nearest to it at its sub-block's step; that step, read from the bytes at the
    offsets llama.cpp's block structs give, maps the sub-block's largest value to about -127 (IQ4_XS:
    within about one ``d``, its 6-bit scale clipping at 31); diffusers' torch dequantizer reads the
    same values."""
    from fixtures.gguf_iq4 import KVALUES, quantize_iq4_nl, quantize_iq4_xs

    rows = _rows()
    packed = (quantize_iq4_nl if qtype == "IQ4_NL" else quantize_iq4_xs)(rows)
    block, type_size = gguf.GGML_QUANT_SIZES[T[qtype]]
    assert packed.dtype == np.uint8 and packed.shape == (8, 512 // block * type_size)
    blocks = packed.reshape(-1, type_size)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if qtype == "IQ4_NL":
        step = d
    else:
        high = blocks[:, 2:4].copy().view(np.uint16)
        low = np.stack([blocks[:, 4:8] & 15, blocks[:, 4:8] >> 4], axis=-1).reshape(-1, 8)
        scales = low | (((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8) << 4)
        step = (d * (scales.astype(np.float32) - 32)).reshape(-1, 1)
    sub = rows.reshape(-1, 32)
    values = gguf.quants.dequantize(packed, T[qtype]).reshape(-1, 32)
    nearest = np.abs(step[..., None] * KVALUES - sub[..., None]).min(axis=-1)
    assert np.allclose(np.abs(values - sub), nearest, rtol=1e-5, atol=1e-7)
    extreme = np.take_along_axis(sub, np.abs(sub).argmax(axis=-1)[:, None], axis=-1)[:, 0]
    slack = 2.0 ** -10 * np.abs(extreme) / 127 if qtype == "IQ4_NL" else np.repeat(d[:, 0], 8) * 1.05
    assert (np.abs(step[:, 0] - extreme / -127) <= slack + 1e-12).all()
    exact = dequantize_functions[T[qtype]](torch.from_numpy(blocks.copy()), block, type_size, dtype=torch.float32)
    assert torch.equal(exact.reshape(values.shape), torch.from_numpy(values))

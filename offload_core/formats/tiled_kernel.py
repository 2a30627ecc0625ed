"""NVFP4 and MXFP8 weights (`formats/nvfp4.py`, `formats/mxfp8.py`) into compute values in one pass
on a GPU: each element's value times its block's scale, read from cuBLAS's tiled layout
(`tiled_scales`), rounded once.

Why: below Blackwell comfy-kitchen decodes MXFP8 with torch ops (float32 copies of the weight, an
untiled copy of the scales) and NVFP4 with a slower CUDA kernel (bench/README.md, run 52). The
math is comfy-kitchen's: MXFP8 ``float(v) * 2^e``, NVFP4 ``(float(v) * block) * tensor`` in
float32, rounded once: its bits (tests/gpu/test_tiled_kernel.py). Where the kernel cannot run
(no CUDA tensor, no Triton, a failed compile) the layers use comfy-kitchen's decode.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds
    triton = None

ROWS, COLS = 16, 256  # a program's tile: rows × stored columns (packed bytes for NVFP4)
_broken: set[int] = set()  # devices where a kernel failed once: comfy-kitchen's decode there

if triton is not None:

    @triton.jit
    def _tiled_offset(r, b, col_tiles):
        """The offset of row ``r``'s block ``b`` scale in cuBLAS's layout: tiles of 128 rows × 4
        blocks (512 bytes), inside one row ``r % 32`` at 16 bytes, ``r // 32 % 4`` at 4, the block at 1."""
        return ((r // 128) * col_tiles + b // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + b % 4

    @triton.jit
    def _fp8(byte):
        """An fp8 (E4M3) byte's value, float32, from its bits (any GPU: no fp8 conversion needed; the
        NaN code, which no scale or weight holds, reads 480)."""
        byte = byte.to(tl.int32)
        e, m = (byte >> 3) & 15, byte & 7
        normal = (((byte >> 7) << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        tiny = m.to(tl.float32) * 0.001953125  # 2^-9: a subnormal's step
        return tl.where(e == 0, tl.where((byte & 128) != 0, -tiny, tiny), normal)

    @triton.jit
    def _e2m1(nibble):
        """An fp4 (E2M1) code's value, float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6, the sign in bit 3."""
        e = (nibble >> 1) & 3
        m = (nibble & 1).to(tl.float32)
        mag = tl.where(e == 0, m * 0.5, tl.where(e == 1, 1.0 + m * 0.5, tl.where(e == 2, 2.0 + m, 4.0 + 2.0 * m)))
        return tl.where((nibble & 8) != 0, -mag, mag)

    @triton.jit
    def _nvfp4_kernel(src, blocks, tensor, dst, rows, half, col_tiles, ROWS: tl.constexpr, COLS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        c = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]  # packed columns
        mask = (r < rows) & (c < half)
        byte = tl.load(src + r.to(tl.int64) * half + c, mask=mask, other=0).to(tl.int32)
        scale = _fp8(tl.load(blocks + _tiled_offset(r, c // 8, col_tiles), mask=mask, other=0))
        g = tl.load(tensor)
        even, odd = (_e2m1(byte >> 4) * scale) * g, (_e2m1(byte & 15) * scale) * g  # the high nibble first
        out = tl.interleave(even, odd).to(dst.dtype.element_ty)
        oc = tl.program_id(1) * COLS * 2 + tl.arange(0, COLS * 2)[None, :]
        tl.store(dst + r.to(tl.int64) * half * 2 + oc, out, mask=(r < rows) & (oc < half * 2))

    @triton.jit
    def _mxfp8_kernel(src, blocks, dst, rows, cols, col_tiles, ROWS: tl.constexpr, COLS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        c = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]
        mask = (r < rows) & (c < cols)
        x = _fp8(tl.load(src + r.to(tl.int64) * cols + c, mask=mask, other=0))
        e = tl.load(blocks + _tiled_offset(r, c // 32, col_tiles), mask=mask, other=0).to(tl.int32)
        scale = (e << 23).to(tl.float32, bitcast=True)  # E8M0: 2^(e - 127), 0 for e = 0 as comfy-kitchen reads it
        tl.store(dst + r.to(tl.int64) * cols + c, (x * scale).to(dst.dtype.element_ty), mask=mask)


def available(t: torch.Tensor) -> bool:
    """Whether the kernels run on ``t``'s device."""
    return triton is not None and t.is_cuda and t.device.index not in _broken


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return triton.cdiv(rows, ROWS), triton.cdiv(cols, COLS)


def nvfp4(packed: torch.Tensor, tensor: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The decoded weight of an NVFP4 layer (``packed`` uint8 rows, high nibble first; ``blocks``
    fp8 tiled; ``tensor`` the float32 tensor scale), or None where the kernel cannot run."""
    if not (available(packed) and packed.is_contiguous()):
        return None
    rows, half = packed.shape
    out = torch.empty(rows, half * 2, dtype=dtype, device=packed.device)
    try:
        _nvfp4_kernel[_grid(rows, half)](packed, blocks.view(torch.uint8), tensor, out, rows,
                                         half, blocks.shape[1] // 4, ROWS=ROWS, COLS=COLS)
    except Exception:  # a Triton that cannot compile here: comfy-kitchen's decode, for good on this device
        _broken.add(packed.device.index)
        return None
    return out


def mxfp8(q: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The decoded weight of an MXFP8 layer (``q`` fp8 rows, ``blocks`` E8M0 tiled), or None where
    the kernel cannot run."""
    if not (available(q) and q.is_contiguous()):
        return None
    rows, cols = q.shape
    out = torch.empty(rows, cols, dtype=dtype, device=q.device)
    try:
        _mxfp8_kernel[_grid(rows, cols)](q.view(torch.uint8), blocks.view(torch.uint8), out, rows, cols,
                                         blocks.shape[1] // 4, ROWS=ROWS, COLS=COLS)
    except Exception:
        _broken.add(q.device.index)
        return None
    return out

"""A GGUF weight's packed blocks into compute values in one launch (Q8_0, Q4_0/1, Q5_0/1, Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K), for diffusers' ``GGUFLinear`` on a CUDA device (`gguf_dequant.GgufDequantHook`).

Own code because diffusers dequantises with a dozen torch ops per layer (splits, shifts, masks,
products; ``quantizers/gguf/utils.py``), each a launch and a full-size temporary, and its fast path
needs CUDA kernels fetched from the hub at import. The math is diffusers' own, rounding for
rounding: each of its fp16 products and sums rounds to fp16 (torch computes a half op in float and
rounds once), then the value is cast to the compute dtype, so the bits are those of
``dequantize_gguf_tensor(w).to(compute)``. A program covers ``NB`` blocks (of 32 values, or 256 for
K-quants); each value gathers its bytes from its block (llama.cpp's layouts, as diffusers reads them).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds
    triton = None

# ggml quant type -> (values per block, bytes per block)
LAYOUTS: dict[int, tuple[int, int]] = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                                       10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
                                       14: (256, 210)}
VALUES_PER_PROGRAM, WARPS = 1024, 4
_broken: set[int] = set()  # devices where the kernel failed once: they use diffusers' ops

if triton is not None:

    @triton.jit
    def _f16(x):
        """One of diffusers' fp16 results: rounded to fp16 (and held in float32)."""
        return x.to(tl.float16).to(tl.float32)

    @triton.jit
    def _half(at, mask):
        return tl.load(at.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _byte(at, mask):
        return tl.load(at, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _nibble(at, e, mask):
        """Value ``e`` of a 32-value block's 16 bytes of 4-bit codes (low nibbles first)."""
        return (_byte(at + e % 16, mask) >> ((e // 16) * 4)) & 15

    @triton.jit
    def _k_scale_min(at, j, mask):
        """Sub-block ``j``'s 6-bit scale and min from a K-quant's 12 packed bytes at ``at``."""
        a = _byte(at + j % 4, mask)
        b = _byte(at + 4 + j % 4, mask)
        c = _byte(at + 8 + j % 4, mask)
        sc = tl.where(j < 4, a & 63, (c & 15) | ((a >> 2) & 48))
        mn = tl.where(j < 4, b & 63, (c >> 4) | ((b >> 2) & 48))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _gguf_kernel(src, dst, nblocks, QT: tl.constexpr, K: tl.constexpr, T: tl.constexpr, NB: tl.constexpr):
        blocks = tl.program_id(0) * NB + tl.arange(0, NB)
        e = tl.arange(0, K)[None, :]  # a value's place in its block
        valid = blocks < nblocks
        mask = valid[:, None] & (e >= 0)
        at = (src + blocks.to(tl.int64) * T)[:, None]  # each block's first byte
        d = _half(at, valid[:, None])
        if QT == 8:  # Q8_0: d, 32 int8
            q = tl.load((at + 2 + e).to(tl.pointer_type(tl.int8)), mask=mask, other=0).to(tl.float32)
            out = _f16(d * q)
        elif QT == 2:  # Q4_0: d, 16 bytes of codes, value = d * (q - 8)
            out = _f16(d * (_nibble(at + 2, e, mask) - 8).to(tl.float32))
        elif QT == 3:  # Q4_1: d, m, codes; d * q + m
            out = _f16(_f16(d * _nibble(at + 4, e, mask).to(tl.float32)) + _half(at + 2, valid[:, None]))
        elif QT == 6:  # Q5_0: d, 32 high bits, codes; d * (q - 16)
            q = _nibble(at + 6, e, mask) | (((_byte(at + 2 + e // 8, mask) >> (e % 8)) & 1) << 4)
            out = _f16(d * (q - 16).to(tl.float32))
        elif QT == 7:  # Q5_1: d, m, 32 high bits, codes; d * q + m
            q = _nibble(at + 8, e, mask) | (((_byte(at + 4 + e // 8, mask) >> (e % 8)) & 1) << 4)
            out = _f16(_f16(d * q.to(tl.float32)) + _half(at + 2, valid[:, None]))
        elif QT == 12 or QT == 13:  # Q4_K / Q5_K: d, dmin, 12 scale bytes, [Q5_K: 32 high-bit bytes], 128 code bytes
            j, c = e // 32, e % 32
            sc, mn = _k_scale_min(at + 4, j, mask)
            if QT == 12:
                q = (_byte(at + 16 + (j // 2) * 32 + c, mask) >> ((j % 2) * 4)) & 15
            else:
                q = (_byte(at + 48 + (j // 2) * 32 + c, mask) >> ((j % 2) * 4)) & 15
                q = q | (((_byte(at + 16 + c, mask) >> j) & 1) << 4)
            out = _f16(_f16(_f16(d * sc) * q.to(tl.float32)) - _f16(_half(at + 2, valid[:, None]) * mn))
        elif QT == 10:  # Q2_K: 16 scale bytes (scale low, min high), 64 bytes of 2-bit codes, d, dmin
            sb = _byte(at + e // 16, mask)
            h, r = e // 128, e % 128
            q = (_byte(at + 16 + h * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
            dl = _f16(_half(at + 80, valid[:, None]) * (sb & 15).to(tl.float32))
            ml = _f16(_half(at + 82, valid[:, None]) * (sb >> 4).to(tl.float32))
            out = _f16(_f16(dl * q.to(tl.float32)) - ml)
        elif QT == 11:  # Q3_K: 32 inverted high-bit bytes, 64 bytes of 2-bit codes, 12 bytes of 6-bit scales, d
            t = e // 16
            low = (_byte(at + 96 + t % 8, mask) >> ((t // 8) * 4)) & 15
            high = (_byte(at + 104 + t % 4, mask) >> ((t // 4) * 2)) & 3
            h, r = e // 128, e % 128
            q = (_byte(at + 32 + h * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
            q = q - ((((_byte(at + e % 32, mask) >> (e // 32)) & 1) ^ 1) << 2)
            dl = _f16(_half(at + 108, valid[:, None]) * ((low | (high << 4)) - 32).to(tl.float32))
            out = _f16(dl * q.to(tl.float32))
        else:  # Q6_K: 128 low-nibble bytes, 64 high-bit bytes, 16 int8 scales, d
            d = _half(at + 208, valid[:, None])
            h, r = e // 128, e % 128
            low = (_byte(at + h * 64 + r % 64, mask) >> ((r // 64) * 4)) & 15
            high = (_byte(at + 128 + h * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
            sc = tl.load((at + 192 + e // 16).to(tl.pointer_type(tl.int8)), mask=mask, other=0).to(tl.float32)
            out = _f16(_f16(d * sc) * ((low | (high << 4)) - 32).to(tl.float32))
        tl.store(dst + blocks.to(tl.int64)[:, None] * K + e, out.to(dst.dtype.element_ty), mask=mask)


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and t.device.index not in _broken


def dequantized(weight: torch.Tensor, compute: torch.dtype) -> torch.Tensor | None:
    """A diffusers ``GGUFParameter``'s value in ``compute`` (its ``quant_shape``), or None where the
    kernel cannot take it (another quant type, not on a CUDA device, no Triton): the caller runs
    diffusers' own dequantisation."""
    layout = LAYOUTS.get(int(getattr(weight, "quant_type", -1)))
    if layout is None or not available(weight):
        return None
    raw = weight.as_tensor().view(torch.uint8) if hasattr(weight, "as_tensor") else weight.view(torch.uint8)
    if not raw.is_contiguous():
        return None
    out = torch.empty(tuple(weight.quant_shape), dtype=compute, device=raw.device)
    try:
        launch(out, raw, int(weight.quant_type))
    except Exception:  # a Triton that cannot compile here: diffusers' ops, for good on this device
        _broken.add(raw.device.index)
        return None
    return out


def launch(out: torch.Tensor, raw: torch.Tensor, quant_type: int) -> None:
    """The kernel over ``raw`` (a weight's packed bytes) into ``out`` (a CPU test runs it in Triton's interpreter)."""
    values, size = LAYOUTS[quant_type]
    nblocks = raw.numel() // size
    per = VALUES_PER_PROGRAM // values
    _gguf_kernel[(triton.cdiv(nblocks, per),)](raw, out, nblocks, QT=quant_type, K=values, T=size, NB=per,
                                               num_warps=WARPS)

"""Fused kernels between stored and compute values: a unit's fp8 region into compute values with
each weight's scale, a unit's int8 region (ComfyUI's int8_tensorwise) with each weight's per-tensor
or per-row scales, and (for fp8 matmuls, `fp8_matmul.py`) an activation into fp8, clamped, in one pass.

Own code because torch has none that does this at memory speed: its fp8 -> bf16 ``copy_`` runs
at about a quarter of the H200's bandwidth and a separate scale multiply is another full pass
(bench/README.md, "fp8 cast"). Triton ships with torch's CUDA builds; where it is missing, or the
GPU has no fp8 conversion (before sm_89), the caller falls back to ``copy_`` + ``mul_``.

Each element takes the scale of the last weight starting at or before it (a weight's start is
an element offset of the region); a program covers ``BLOCK`` elements, wide enough for 16-byte
loads (`bench/cast_probe.py` sweeps the width), finds the weights it meets from the whole table at
once, and selects per element only where it meets more than one. Math: ``float(fp8) * scale``
rounded once to the compute dtype, the bits of ``w.to(c) * scale``. int8 the same way, each element's
scale that of its row: a program covers a tile (``INT8_BLOCK`` columns of one row of one weight),
finds its weight in the table of the region's weights at once and its row by one division, so no
element searches; ``float(q) * scale`` rounded once, the bits of ``fp8.dequantize_int8`` (float32
scales; torch's cast makes a float32 copy: bench/README.md, runs 49-50).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds
    triton = None

BLOCK, WARPS = 4096, 4  # elements per program, warps per program (the probe's sweep picks them)
INT8_BLOCK, INT8_WARPS = 1024, 4  # columns of one row per int8 tile, warps per program (bench/int8_cast_probe.py)
_broken: set[int] = set()  # devices where the kernel failed once: they use the fallback
_unscaled: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # the one-segment table of scale 1, per device

if triton is not None:

    @triton.jit
    def _cast_kernel(src, dst, starts, scales, n, nseg, BLOCK: tl.constexpr, NSEG: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src + offs, mask=mask).to(tl.float32)
        if NSEG == 1:  # one scale (an unscaled region): no table to search
            tl.store(dst + offs, (x * tl.load(scales)).to(dst.dtype.element_ty), mask=mask)
            return
        segs = tl.arange(0, NSEG)
        st = tl.load(starts + segs, mask=segs < nseg, other=n + BLOCK)
        first = tl.sum((st <= pid * BLOCK).to(tl.int32), axis=0) - 1  # the segments this program meets
        last = tl.sum((st < pid * BLOCK + BLOCK).to(tl.int32), axis=0) - 1
        scale = tl.zeros([BLOCK], dtype=tl.float32) + tl.load(scales + first)
        for i in range(first + 1, last + 1):  # none for a program inside one weight
            scale = tl.where(offs >= tl.load(starts + i), tl.load(scales + i), scale)
        tl.store(dst + offs, (x * scale).to(dst.dtype.element_ty), mask=mask)


    @triton.jit
    def _int8_kernel(src, dst, firsts, offsets, widths, bases, steps, scales, nw, BLOCK: tl.constexpr,
                     NW: tl.constexpr):
        pid = tl.program_id(0)  # one tile: BLOCK columns of one row of one weight
        ws = tl.arange(0, NW)
        w = tl.sum((tl.load(firsts + ws, mask=ws < nw, other=2**31 - 1) <= pid).to(tl.int32), axis=0) - 1
        local = pid - tl.load(firsts + w)
        width = tl.load(widths + w)
        per_row = tl.cdiv(width, BLOCK)
        row = local // per_row  # once a program, not per element
        cols = (local - row * per_row) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        at = tl.load(offsets + w) + row.to(tl.int64) * width + cols
        scale = tl.load(scales + tl.load(bases + w) + row * tl.load(steps + w))
        x = tl.load(src + at, mask=mask).to(tl.float32)
        tl.store(dst + at, (x * scale).to(dst.dtype.element_ty), mask=mask)


    @triton.jit
    def _cast_scalar_kernel(src, dst, n, scale, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src + offs, mask=mask).to(tl.float32)
        tl.store(dst + offs, (x * scale).to(dst.dtype.element_ty), mask=mask)


    @triton.jit
    def _quantize_kernel(src, dst, n, inv_scale, SCALED: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src + offs, mask=mask)
        if SCALED:  # the product in the input's dtype, as ``x * inv.to(x.dtype)`` rounds it
            x = (x.to(tl.float32) * tl.load(inv_scale).to(tl.float32)).to(src.dtype.element_ty)
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
        tl.store(dst + offs, x.to(tl.float8e4nv), mask=mask)


def available(t: torch.Tensor, fp8: bool = True) -> bool:
    """Whether the kernels run on ``t``'s device (``fp8``: one with fp8 conversions, sm_89 on)."""
    if triton is None or not t.is_cuda or t.device.index in _broken:
        return False
    return not fp8 or torch.cuda.get_device_capability(t.device) >= (8, 9)


def cast_into(out: torch.Tensor, src: torch.Tensor, starts: torch.Tensor | None = None,
              scales: torch.Tensor | None = None) -> bool:
    """``out[i] = src[i] * scale`` (scale of the segment holding ``i``: ``starts`` ascending
    int64 element offsets from 0, ``scales`` float32, both on the device); without a table every
    scale is 1. False when the kernel cannot run here (the caller falls back)."""
    if not available(src):
        return False
    if starts is None:
        if src.device not in _unscaled:
            _unscaled[src.device] = (torch.zeros(1, dtype=torch.int64, device=src.device),
                                     torch.ones(1, dtype=torch.float32, device=src.device))
        starts, scales = _unscaled[src.device]
    try:
        launch(out, src, starts, scales, BLOCK, WARPS)
    except Exception:  # a Triton that cannot compile here: the fallback, for good on this device
        _broken.add(src.device.index)
        return False
    return True


def launch(out: torch.Tensor, src: torch.Tensor, starts: torch.Tensor, scales: torch.Tensor, block: int,
           warps: int) -> None:
    """The cast kernel at a given width (``cast_into`` uses the module's; the probe sweeps others)."""
    nseg = starts.numel()
    _cast_kernel[(triton.cdiv(src.numel(), block),)](src, out, starts, scales, src.numel(), nseg, BLOCK=block,
                                                     NSEG=triton.next_power_of_2(nseg), num_warps=warps)


def cast_int8_into(out: torch.Tensor, src: torch.Tensor, table: tuple | None) -> bool:
    """``out[i] = float(src[i]) * scale`` of the row holding ``i`` (``table``: `int8_table` on the
    device). False when the kernel cannot run here, or ``table`` is None (the caller falls back)."""
    if table is None or not available(src, fp8=False):
        return False
    try:
        launch_int8(out, src, table)
    except Exception:  # as for the fp8 kernel
        _broken.add(src.device.index)
        return False
    return True


def int8_table(offsets: list[int], shapes: list[torch.Size], scales: list[torch.Tensor], device: torch.device,
               block: int = INT8_BLOCK) -> tuple | None:
    """The int8 kernel's table for weights at element ``offsets`` of a region, at ``block`` columns
    a tile: per weight its first tile, offset, row width, first scale and scale step (0: one scale),
    every scale in a row, the tile count and the weight count; None where a scale is not float32
    or there are too many weights for one search (the caller casts by torch)."""
    if any(s.dtype != torch.float32 for s in scales) or len(shapes) > 256:
        return None
    firsts, widths, bases, steps, tiles, base = [], [], [], [], 0, 0
    for shape, scale in zip(shapes, scales, strict=True):
        rows = shape[0] if len(shape) > 1 else 1
        firsts.append(tiles)
        widths.append(shape.numel() // rows)
        bases.append(base)
        steps.append(int(scale.numel() > 1))
        tiles += rows * -(-widths[-1] // block)
        base += scale.numel()
    ints = [torch.tensor(t, dtype=torch.int32, device=device) for t in (firsts, widths, bases, steps)]
    return (ints[0], torch.tensor(offsets, dtype=torch.int64, device=device), *ints[1:],
            torch.cat([s.reshape(-1) for s in scales]).to(device), tiles, len(shapes))


def launch_int8(out: torch.Tensor, src: torch.Tensor, table: tuple, block: int = 0, warps: int = 0) -> None:
    """The int8 kernel on ``table`` (`int8_table`, built for ``block``; the probe sweeps widths, a CPU
    test runs it in Triton's interpreter)."""
    *tensors, tiles, count = table
    _int8_kernel[(tiles,)](src, out, *tensors, count, BLOCK=block or INT8_BLOCK, NW=triton.next_power_of_2(count),
                           num_warps=warps or INT8_WARPS)


def dequantized(weight: torch.Tensor, scale: float | None, compute: torch.dtype) -> torch.Tensor | None:
    """One weight's compute value (``scale`` already rounded to ``compute``), or None where the
    kernel cannot run (the caller falls back)."""
    if not (available(weight) and weight.is_contiguous()):
        return None
    out = torch.empty(weight.shape, dtype=compute, device=weight.device)
    n = weight.numel()
    try:
        _cast_scalar_kernel[(triton.cdiv(n, 1024),)](weight, out, n, 1.0 if scale is None else scale, BLOCK=1024,
                                                     num_warps=4)
    except Exception:
        _broken.add(weight.device.index)
        return None
    return out


def quantized(x: torch.Tensor, inv_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x`` (bf16/fp16, contiguous) as ``float8_e4m3fn`` in one pass: times ``inv_scale`` (a
    scalar of ``x``'s dtype on its device) where given, clamped to ±448, rounded to nearest: the bits
    of ``(x * inv_scale).clamp(-448, 448).to(float8_e4m3fn)``; None where the kernel cannot run."""
    if not (available(x) and x.is_contiguous()):
        return None
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    n = x.numel()
    try:
        _quantize_kernel[(triton.cdiv(n, 4096),)](x, out, n, x if inv_scale is None else inv_scale,
                                                  SCALED=inv_scale is not None, BLOCK=4096, num_warps=4)
    except Exception:
        _broken.add(x.device.index)
        return None
    return out

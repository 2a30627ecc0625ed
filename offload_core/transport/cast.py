"""fp8 units of the block streamer: one cast per unit into the buffer its forward computes from.

A unit's fp8 weights lie first in its layout (`blocks.make_block`), so its fp8 bytes are one
contiguous region: one kernel (`fp8_kernel.py`) turns that region into compute-dtype values with
each weight's scale, element for byte (an fp8 weight at byte offset ``o`` is the compute value at
element ``o``); without it, a ``copy_`` and a ``mul_`` per scaled weight. Why not a cast per layer (diffusers' layerwise
casting, ComfyUI's cast per op): the per-layer launches cost more than the bytes saved on a
streamed image step (bench/README.md, formats). The storage bytes (a ring buffer, a kept piece)
are what moves and stays; the compute buffer lives only while the unit runs, from a small pool
on the compute stream, so reusing one is ordered after the unit that last read it (a kept piece
held as compute values, `held_casts.py`, is cast once instead).
int8 units (ComfyUI's int8_tensorwise) take the kernel's int8 twin, each element scaled by its row
(the bits of `fp8.dequantize_int8`, ``(q.float() * scale).to(compute)``, per-tensor or per-row
float32 scales); without it, or for float64 scales, torch casts each weight; element for byte as
well (int8 is one byte).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats.fp8 import Fp8Table, dequantize, dequantize_int8
from . import fp8_kernel


@dataclass(eq=False)
class UnitCast:
    storage: torch.dtype
    compute: torch.dtype
    count: int  # fp8 slots, first in the unit
    nbytes: int  # bytes of the fp8 region from the unit's start = elements of its compute buffer
    offsets: list[int]  # each fp8 slot's byte offset from the unit's start
    shapes: list[torch.Size]  # and its shape
    scaled: list[int] = field(default_factory=list)  # positions (among the fp8 slots) with a scale
    scales: list[float] = field(default_factory=list)
    int8_scales: list[torch.Tensor] | None = None  # an int8 unit: each slot's scale

    _table: tuple[torch.Tensor, torch.Tensor] | None = None  # the kernel's (starts, scales), on the device
    _int8_on: list[torch.Tensor] | None = None  # int8_scales on the device
    _int8_kernel_table: dict[torch.device, tuple | None] = field(default_factory=dict)  # the int8 kernel's table

    @property
    def compute_bytes(self) -> int:
        return self.nbytes * self.compute.itemsize

    def table(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Each fp8 weight's start and scale for `fp8_kernel.cast_into` (None: none is scaled)."""
        if not self.scaled:
            return None, None
        if self._table is None or self._table[0].device.index != device.index:
            by_slot = dict(zip(self.scaled, self.scales, strict=True))
            scales = [by_slot.get(i, 1.0) for i in range(self.count)]
            self._table = (
                torch.tensor(self.offsets, dtype=torch.int64, device=device),
                torch.tensor(scales, dtype=torch.float32, device=device),
            )
        return self._table

    def int8_scales_on(self, device: torch.device) -> list[torch.Tensor]:
        """Each int8 weight's scale on the device (copied there once)."""
        if self._int8_on is None or self._int8_on[0].device != device:
            self._int8_on = [s.to(device) for s in self.int8_scales]
        return self._int8_on

    def int8_table(self, device: torch.device) -> tuple | None:
        """The int8 kernel's table of this unit's weights on ``device`` (`fp8_kernel.int8_table`, made once)."""
        if device not in self._int8_kernel_table:
            self._int8_kernel_table[device] = fp8_kernel.int8_table(self.offsets, self.shapes, self.int8_scales, device)
        return self._int8_kernel_table[device]


def unit_cast(
    table: Fp8Table | None, tensors: list[torch.Tensor], offsets: list[int], end: int
) -> UnitCast | None:
    """The cast of a unit whose tensors (fp8 ones first) lie at ``offsets`` from its start;
    ``end``: where its fp8 region ends. None when none is fp8, or when they compute as fp8
    matmuls (no cast: `fp8_matmul.py`)."""
    if table is None or table.matmul:
        return None
    fp8 = [i for i, t in enumerate(tensors) if table.holds(t)]
    if not fp8:
        return None
    assert fp8 == list(range(len(fp8))), "fp8 tensors must lead the unit's layout"
    head = (table.storage, table.compute, len(fp8), end, offsets[: len(fp8)], [tensors[i].shape for i in fp8])
    if table.int8:
        return UnitCast(*head, int8_scales=[table.int8_scales[id(tensors[i])] for i in fp8])
    scaled = [i for i in fp8 if table.scale_of(tensors[i]) is not None]
    return UnitCast(*head, scaled, [table.scale_of(tensors[i]) for i in scaled])


def compute_views(buf: torch.Tensor, cast: UnitCast) -> list[torch.Tensor]:
    """The fp8 slots' compute values in ``buf``, element for byte."""
    return [buf[o : o + s.numel()].view(s) for o, s in zip(cast.offsets, cast.shapes, strict=True)]


def cast_into(cast: UnitCast, region: torch.Tensor, buf: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Cast ``region`` (a unit's storage bytes, from its start) into ``buf`` (``views``: its
    `compute_views`)."""
    src, dst = region[: cast.nbytes].view(cast.storage), buf[: cast.nbytes]
    if cast.int8_scales is not None:
        if fp8_kernel.available(src, fp8=False) and fp8_kernel.cast_int8_into(dst, src, cast.int8_table(buf.device)):
            return
        for view, o, scale in zip(views, cast.offsets, cast.int8_scales_on(buf.device), strict=True):
            dequantize_int8(src[o : o + view.numel()].view(view.shape), scale, cast.compute, out=view)
    elif not fp8_kernel.cast_into(dst, src, *cast.table(buf.device)):
        dst.copy_(src)
        for i, scale in zip(cast.scaled, cast.scales, strict=True):  # (a foreach rounds the scale first)
            views[i].mul_(scale)


class CastPool:
    """Compute buffers for the fp8 units bound now, with each buffer's views per unit cached
    (building views is most of the host time a unit costs). One of them may be *fixed* for the
    CUDA graphs (`fix`): their captures cast into it, so graphs need no cast buffer of their own."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.Tensor] = []
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}  # (id(buffer), unit index) -> views
        self.held = 0  # bytes of compute buffers alive (free and bound)
        self.peak = 0  # the most ``held`` since `reset_peak` (a cycle's)
        self.nbytes = 0  # the size buffers are made at: the largest unit's compute bytes
        self.fixed: torch.Tensor | None = None  # the graphs' cast buffer: never freed while fixed
        self._fixed_bound = False  # an eager unit is bound to it now

    def cast(
        self, index: int, cast: UnitCast, region: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Cast ``region`` (the unit's storage bytes, from its start) into a compute buffer;
        returns the buffer (give it back with `release`) and the fp8 slots' compute views."""
        buf = self._take(cast)
        key = (id(buf), index)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = compute_views(buf, cast)
        cast_into(cast, region, buf, views)
        return buf, views

    def release(self, buf: torch.Tensor) -> None:
        if buf is self.fixed:
            self._fixed_bound = False
        elif not self._free and buf.numel() * buf.element_size() == self.nbytes:
            self._free.append(buf)
        else:
            self._forget(buf)

    def fix(self, compute: torch.dtype) -> torch.Tensor:
        """The buffer CUDA graph captures cast into, made (outside any capture: a buffer made
        inside one would belong to the graphs' pool) and kept until `unfix`. Graphs replay one
        after another on the compute stream, as eager units bind one after another, so eager
        casts use it too while no unit is bound to it: the graphs cost no second cast buffer.
        One fixed buffer at a time, never replaced while graphs may read it (a unit of another
        compute dtype casts inside its capture instead: `fixed_for`)."""
        if self.fixed is None:
            if self._free and self._free[-1].dtype == compute:
                self.fixed = self._free.pop()
            else:
                self.fixed = torch.empty(self.nbytes // compute.itemsize, dtype=compute, device=self.device)
                self._hold(self.fixed)
        return self.fixed

    def fixed_for(self, cast: UnitCast) -> torch.Tensor | None:
        """The fixed buffer if ``cast`` can use it (its compute dtype, big enough), else None."""
        fixed = self.fixed
        if fixed is not None and fixed.dtype == cast.compute and fixed.numel() >= cast.nbytes:
            return fixed
        return None

    def unfix(self) -> None:
        """The graphs are dropped: the fixed buffer becomes an ordinary one (freed at `clear`)."""
        buf, self.fixed = self.fixed, None
        if buf is not None and not self._fixed_bound:
            self.release(buf)
        self._fixed_bound = False

    def resize(self, nbytes: int) -> None:
        if nbytes != self.nbytes:
            self.clear()
            self.nbytes = nbytes

    def clear(self) -> None:
        while self._free:
            self._forget(self._free.pop())

    def _take(self, cast: UnitCast) -> torch.Tensor:
        fixed = self.fixed_for(cast)
        if fixed is not None and not self._fixed_bound:
            self._fixed_bound = True
            return fixed
        if self._free and self._free[-1].dtype == cast.compute:
            return self._free.pop()
        size = max(self.nbytes, cast.compute_bytes) // cast.compute.itemsize
        buf = torch.empty(size, dtype=cast.compute, device=self.device)
        self._hold(buf)
        return buf

    def reset_peak(self) -> None:
        self.peak = self.held

    def _hold(self, buf: torch.Tensor) -> None:
        self.held += buf.numel() * buf.element_size()
        self.peak = max(self.peak, self.held)

    def _forget(self, buf: torch.Tensor) -> None:
        self.held -= buf.numel() * buf.element_size()
        for key in [k for k in self._views if k[0] == id(buf)]:
            del self._views[key]


def weight_value(table: Fp8Table, weight: torch.Tensor) -> torch.Tensor:
    """One fp8 weight's (the layer's parameter: its scale is looked up by it) compute value, from
    its data (the per-layer paths: `dequant.py`, `fp8_matmul.py`'s fallback): the kernel where it
    runs, else ``to`` and ``mul_``."""
    scale, compute, data = table.scale_of(weight), table.compute, weight.data
    fast = fp8_kernel.dequantized(data, scale, compute)
    return fast if fast is not None else dequantize(data, scale, compute)

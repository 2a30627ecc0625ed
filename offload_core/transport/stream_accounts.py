"""What a block streamer holds, read from its table: which pieces are kept, and the byte counts
the planner, the report and ComfyUI's model sizes read (stored bytes; a piece held as compute
values counts what it takes on the device). Read-only: the streamer changes the table."""

from __future__ import annotations

from ..pinning import is_locked
from .base import Masters


class StreamAccounts:
    """Mixed into `BlockStreamer` (its table: ``blocks``, ``units``, ``pieces``, ``ring``, ``prefetch``)."""

    def pieces_of(self, blocks: set[int]) -> set[int]:
        """The pieces of the blocks ``blocks`` (block-table indices): keeping blocks whole."""
        return {p.index for p in self.pieces if p.block.index in blocks}

    def resident_blocks(self) -> set[int]:
        """Blocks with every piece resident."""
        return {b.index for b in self.blocks if all(u.piece.resident is not None for u in b.units)}

    def resident_indices(self) -> set[int]:
        return {p.index for p in self.pieces if p.resident is not None}

    def _largest_streamed(self) -> int:
        """The ring's buffer size: the largest unit of the pieces not kept."""
        return max((p.largest_unit for p in self.pieces if p.resident is None), default=0)

    def head_bytes(self) -> int:
        return self._head_bytes

    def streamed_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces if p.resident is None)

    def kept_bytes(self) -> int:  # (a piece held as compute values takes more than its stored bytes)
        return sum(p.resident.numel() for p in self.pieces if p.resident is not None)

    def device_bytes(self) -> int:
        """Weights on the device now: the resident part, kept and bound blocks, prefetched buffers
        (read from the block table, not by walking every tensor: it runs once per forward)."""
        if self.module is None or self.device == self.ctx.offload_device:
            return 0
        return self._head_bytes + self.kept_bytes() + self.buffer_bytes()

    def buffer_bytes(self) -> int:
        """The streaming buffers and the fp8 cast buffers held now."""
        return self.ring.nbytes + self.prefetch.casts.held

    def pinned_bytes(self) -> int:
        """Page-locked host bytes: the masters registered in place and the units' packets."""
        packets = (u.packet for u in self.units if u.packet is not None)
        return self.pins.nbytes + sum(p.numel() for p in packets if is_locked(p))

    def run_bytes(self) -> int:
        """The streaming slots (the unit being run plus those filled ahead) and, for fp8 units,
        the compute buffer the running unit is cast into, less those it holds already (a run's
        buffers stay for the next)."""
        casts = self.prefetch.casts
        return (max(self.ring.capacity * self._largest_streamed() - self.ring.nbytes, 0)
                + max(casts.nbytes - casts.held, 0))

    def weights_at_peak(self) -> int:
        """Weight bytes on the device when the allocator peaked: the resident part plus the most
        streamed-block buffers that were alive at once this cycle (the peak happens inside a block,
        with its successor prefetched), and a cast buffer if one was alive this cycle (compiled fp8
        blocks dequantise inside their graph instead: that shows as their activations)."""
        casts = self.prefetch.casts
        return self._head_bytes + self.kept_bytes() + self._transit_peak + min(casts.nbytes, casts.peak)

    def self_cast(self) -> set[int]:
        """The fp8 weights its units cast themselves (one cast per unit, `cast.py`)."""
        return {id(slot.tensor) for u in self.units if u.cast for slot in u.slots[: u.cast.count]}

    def masters(self) -> Masters:
        """Each streamed tensor's host master (a kept piece's device copy is its live ``.data``)."""
        return {id(slot.tensor): [slot.host] for block in self.blocks for slot in block.slots}

    def details(self) -> dict[str, object]:
        return {
            "blocks": len(self.blocks), "pieces": len(self.pieces), "units": len(self.units),
            "kept": len(self.resident_blocks()), "kept_pieces": len(self.resident_indices()),  # whole blocks, pieces
            "kept_bytes": self.kept_bytes(), "streamed_per_step": self.streamed_bytes(),
            "stream": self.prefetch.copy_stream is not None, "window": self.ctx.prefetch_window,
            "buffers": self.ring.capacity, "ooms": self.ooms, "sync_loads": self.prefetch.sync_loads,
            "compiled_blocks": self.compiled.blocks, "compiled_calls": self.compiled.calls,
            **self.graphs.details(),
            **self.prefetch.host_details(self.blocks),
        }

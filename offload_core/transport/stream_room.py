"""What a block streamer gives back when device room is asked for (ComfyUI's memory manager, an
on-demand component moving in, another denoiser's plan): kept pieces first, in `release_order`,
the idle streaming buffers last. Why the buffers last: they serve every forward, a dropped one is
remade at the next, maybe elsewhere, and the CUDA graphs of streamed units are keyed by their
buffer's address, so each such unit is captured again at its first call there."""

from __future__ import annotations

from collections.abc import Iterable


class StreamRoom:
    """Mixed into `BlockStreamer` (its ``prefetch``, ``pieces``, ``set_resident`` and accounts)."""

    def drop_prefetched(self) -> int:
        """The copies made ahead and the idle streaming and cast buffers go; the device bytes freed."""
        before = self.buffer_bytes()
        self.prefetch.drop_prefetched()
        return before - self.buffer_bytes()

    def givable_bytes(self) -> int:
        """Device bytes `give_back` frees at most while the streamer is idle (none of its units
        bound): its kept pieces and its streaming buffers."""
        return self.kept_bytes() + self.ring.nbytes

    def give_back(self, nbytes: int) -> int:
        """Free ``nbytes``: kept pieces first (`give_back_kept`), then, if that was not enough, the
        idle streaming buffers; the bytes freed."""
        buffers = self.buffer_bytes()
        freed = self.give_back_kept(nbytes)  # (a new resident set may resize the ring: counted below)
        if freed < nbytes:
            self.drop_prefetched()
        return freed + max(buffers - self.buffer_bytes(), 0)

    def give_back_kept(self, nbytes: int) -> int:
        """Release kept pieces in `release_order` until ``nbytes`` are freed."""
        keep, freed = self.resident_indices(), 0
        for index in self.release_order():
            if freed >= nbytes:
                break
            if index in keep:
                keep.discard(index)
                freed += self.pieces[index].nbytes
        if freed:
            self.set_resident(keep)
        return freed

    def release_order(self) -> Iterable[int]:
        """The order kept pieces are given up in: last in the table first."""
        return (piece.index for piece in reversed(self.pieces))

"""The block streamer's use of CUDA graphs (`graphs.py`): which blocks may be graphed (those with
every piece kept), when one is captured (after its eager forward, on its second call with those
inputs), and what a capture binds (a kept fp8 unit's weights, cast inside the graph)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .blocks import StreamBlock
from .graphs import CallGraph, GraphCache
from .prefetch import Prefetcher


class KeptGraphs:
    def __init__(self, device: torch.device, enabled: bool, prefetch: Prefetcher) -> None:
        self.cache = GraphCache(device, enabled)
        self.prefetch = prefetch
        self.kept: frozenset[int] = frozenset()  # blocks with every piece kept
        self._pending: tuple | None = None  # (block, args, kwargs, len(seen) at its entry): capture at its exit

    def enter(self, block: StreamBlock, args: tuple, kwargs: dict, seen: list[int]) -> CallGraph | None:
        """A block is entered: its trusted graph, to replay instead of its forward (the units it
        runs are added to ``seen``), or None: run eagerly (maybe to be captured at its exit)."""
        if block.index not in self.kept or not self.cache.enabled:
            return None
        plan = self.cache.plan(block, args, kwargs)
        if type(plan) is CallGraph:
            seen.extend(plan.units)
            return plan
        if plan is GraphCache.CAPTURE:
            self._pending = (block, args, kwargs, len(seen))
        return None

    def exit(self, block: StreamBlock, output: object, forward: Callable[..., object], seen: list[int],
             name: str) -> bool:
        """A block's eager forward returned ``output`` and released its units: captured now if its
        entry asked for it (``forward``: the block's forward under the streamer's hook); True
        when a capture was tried (its allocations are not the forward's)."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not block:
            return False
        _block, args, kwargs, mark = pending
        whole = None if block.in_parts else block.units[0]

        def run(*a, **kw):
            if whole is not None:  # in parts, the parts' hooks bind them
                self.prefetch.bind_captured(whole)
            return forward(*a, **kw)

        self.prefetch.capturing = True
        try:
            self.cache.capture(block, f"{name} {block.name}", run, args, kwargs, output, seen[mark:])
        finally:
            self.prefetch.end_capture()
        return True

    def set_kept(self, kept: frozenset[int], blocks: list[StreamBlock]) -> None:
        """The blocks kept whole now: a block that left loses its graphs (its buffer is gone)."""
        left = self.kept - kept
        if left:
            self.cache.drop({id(blocks[i]) for i in left})
        self.kept = kept

    def enable(self, on: bool) -> None:
        self.cache.enabled = on and self.cache.device.type == "cuda"
        if not self.cache.enabled:
            self.cache.clear()

    def clear(self) -> None:
        self._pending = None
        self.cache.clear()

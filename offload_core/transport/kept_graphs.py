"""The block streamer's use of CUDA graphs (`graphs.py`): when its blocks are graphed (while the
plan keeps every block: nothing streams), when one is captured (after its eager forward, on its
second call with those inputs), and what a capture binds (a kept fp8 unit's weights, cast inside
the graph).

Why only when every block is kept: the graphs' pool (a block's intermediates, an fp8 block's
compute values) is device memory the plan would otherwise keep blocks in. Where blocks stream, the
step is bound by the copies on a fast host, and a piece fewer kept costs more than the launches
saved; where every block is kept, the step is bound by the launches and the pool is spare room.
A plan that starts streaming drops the graphs (their pool goes back to it) and no new ones are
made until the pipeline call ends: the freed room would otherwise bring the blocks back, and
the graphs' pool push them out again, every step."""

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
        self.active = False  # the plan keeps every block and has not displaced graphs this call
        self._displaced = False  # this call's plan streamed after graphs were made
        self._pending: tuple | None = None  # (block, args, kwargs, len(seen) at its entry): capture at its exit

    def enter(self, block: StreamBlock, args: tuple, kwargs: dict, seen: list[int]) -> CallGraph | None:
        """A block is entered: its trusted graph, to replay instead of its forward (the units it
        runs are added to ``seen``), or None: run eagerly (maybe to be captured at its exit)."""
        if not self.active or not self.cache.enabled:
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

    def set_plan(self, streams: bool) -> None:
        """The resident set changed: ``streams`` when a piece is not kept (its block's graph would
        read a buffer that is gone)."""
        if streams and len(self.cache):
            self.cache.clear()
            self._displaced = True
        self.active = not streams and not self._displaced

    def after_run(self, streams: bool) -> None:
        """A pipeline call ended: the next may graph again if its plan keeps every block."""
        self._displaced = False
        self.active = not streams

    def clear(self) -> None:
        self._pending = None
        self.cache.clear()

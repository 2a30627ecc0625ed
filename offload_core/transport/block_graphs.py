"""The block streamer's use of CUDA graphs (`graphs.py`): which calls are graphed, when one is
captured (after its eager forward: on its second call with those inputs and those buffers, or on
its first where the call is trusted, `graphs.py`), and what a capture binds (an fp8 unit's
weights, cast inside the graph).

Two kinds of call are graphed. A block as one graph: a kept block, or a block in parts that
streams some of them, whose units are then all bound at its entry (while its streamed parts fit
the ring with a buffer to spare for the copies ahead; `BlockStreamer._bind_whole`). And a
streamed unit (a block streamed whole; a part, where its block is not bound whole), one graph per
ring buffer it is bound to. Copies and their buffers' events stay outside every graph. A graph
bakes in the addresses it reads, so each is keyed by the device addresses of its weights' bytes:
the same key means the same weights in the same place, whatever the plan did in between, and a
plan change needs no drop, except under cudaMallocAsync, where a graph whose weights left its
place still holds the driver's memory its launches mapped (`drop_moved`). Why graph streaming
blocks too: a streamed image step is bound by the copies only while the host launches faster
than the link copies; on a slow host its eager launch is the step. Why whole where they fit: a
block graphed part by part still launches the ops between its parts, and loads and copies each
part's inputs and outputs, one by one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..log import get_logger
from . import graph_memory
from .blocks import StreamBlock, StreamUnit
from .call_keys import Key
from .graphs import CallGraph, GraphCache
from .prefetch import Prefetcher

log = get_logger("graphs")

Owner = StreamBlock | StreamUnit


class BlockGraphs:
    def __init__(self, device: torch.device, enabled: bool, prefetch: Prefetcher,
                 notify: Callable[[str], object]) -> None:
        self.cache = GraphCache(device, enabled)
        self.head = GraphCache(device, enabled)  # the non-block part's calls (`head_graphs.py`), counted apart
        self.prefetch = prefetch
        self.notify = notify  # the streamer's listeners hear ``capturing`` and ``captured``
        self.model = ""  # the model's name, for the log
        self._pending: tuple | None = None  # (owner, key, args, kwargs, len(seen) at its entry): capture at its exit
        self._placed: tuple | None = None  # the kept pieces, where they lay and the ring buffers `drop_moved` last saw

    def key(self, owner: Owner) -> tuple[tuple, tuple]:
        """Which call this is: the owner and its units' form (stored, or held as compute values:
        `held_casts.py`), then where their bytes lie now (kept or a ring buffer). Trust is keyed
        by the first alone, so a call checked once is captured at its first call in a new place
        (`GraphCache.plan`): kept blocks taken back after the other denoiser ran, streamed units
        in a ring made again. Run 37 had streamed units wait for their second call in each buffer,
        when a unit took whichever buffer was free; since each asks for its own (`ring.py`'s
        homes), a new place lasts."""
        units = owner.units if isinstance(owner, StreamBlock) else (owner,)
        where = tuple(self.prefetch.region(u).data_ptr() for u in units)
        return (id(owner), tuple(u.computed for u in units)), where

    def enter(self, owner: Owner, args: tuple, kwargs: dict, seen: list[int], casts: bool = True) -> CallGraph | None:
        """A kept block or a bound streamed unit is entered: its trusted graph, to replay instead of
        its forward (the units it runs are added to ``seen``), or None: run eagerly (maybe to be
        captured at its exit). ``casts`` False: its capture casts no fp8 unit (a compiled block in
        parts dequantises inside its forward, `compiled.py`), so no cast buffer is fixed for it."""
        if not self.cache.enabled:
            return None
        key = self.key(owner)
        plan = self.cache.plan(key, args, kwargs)
        if type(plan) is CallGraph:
            seen.extend(plan.units)
            return plan
        if plan is GraphCache.CAPTURE:
            self._pending = (owner, key, args, kwargs, len(seen))
            if casts:
                self.prefetch.fix_cast(owner.units if isinstance(owner, StreamBlock) else (owner,))
        return None

    def exit(self, owner: Owner, output: object, forward: Callable[..., object], seen: list[int]) -> None:
        """``owner``'s eager forward returned ``output``: captured now if its entry asked for it
        (``forward``: its forward under the streamer's hook), while a streamed unit is still
        bound. The listeners are told before (the forward's peak so far is theirs) and after (the
        capture's allocations are not)."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not owner:
            return
        _owner, key, args, kwargs, mark = pending
        whole = owner if isinstance(owner, StreamUnit) else None if owner.in_parts else owner.units[0]

        def run(*a, **kw):
            self.prefetch.capturing = True
            try:
                if whole is not None:  # in parts, the parts' hooks bind them
                    self.prefetch.bind_captured(whole)
                return forward(*a, **kw)
            finally:  # inside the capture: a cast buffer made in it is freed in it (`Prefetcher.end_capture`)
                self.prefetch.end_capture()

        self.notify("capturing")
        self.cache.capture(key, f"{self.model} {owner_name(owner)}", run, args, kwargs, output, seen[mark:])
        self.notify("captured")

    def drop_moved(self, kept: frozenset[int]) -> None:
        """The plan was applied (``kept``: the pieces kept now): under cudaMallocAsync the graphs
        of weights that lie elsewhere now (their blocks kept or streamed since, or given back and
        taken again at other addresses; their ring buffer given back) go, with the driver's memory
        their launches mapped (`graph_memory.trim`): else it stays theirs, and a graph that would
        replay instead finds the card that much shorter (graphs may each map their own:
        bench/README.md, run 63). Under the native allocator their pool is shared and nothing is
        mapped: they stay until a `clear`."""
        if not graph_memory.maps_at_launch():
            return
        placed, self._placed = self._placed, (kept, self._kept_at(), frozenset(self.prefetch.ring.addresses))
        if placed == self._placed:
            return
        owners: dict[int, list] = {}
        for unit in self.prefetch.units:
            owners[id(unit)], owners[id(unit.block)] = [unit], unit.block.units

        def moved(owner: tuple[Key, Key]) -> bool:
            (ident, _computed), where = owner
            units = owners.get(ident)
            return units is None or not all(map(self._lies_at, units, where))

        dropped = self.cache.drop(moved)
        if dropped:
            given = graph_memory.trim(self.cache.device)
            log.debug("%s: %d graphs of weights placed elsewhere now dropped, %.0f MiB of the driver's "
                      "graph memory given back", self.model, dropped, given / (1 << 20))

    def _kept_at(self) -> frozenset[int]:
        """Where the kept units' bytes lie now: the same pieces kept at two plans may have been
        given back in between (a decode's room) and taken again elsewhere."""
        return frozenset(u.kept.data_ptr() for u in self.prefetch.units
                         if u.piece.resident is not None and u.kept is not None)

    def _lies_at(self, unit: StreamUnit, address: int) -> bool:
        """Whether ``unit``'s bytes may lie at ``address`` under the plan now: its kept buffer,
        or one of the ring's buffers."""
        if unit.piece.resident is not None:
            return unit.kept is not None and unit.kept.data_ptr() == address
        return address in self.prefetch.ring.addresses

    def enable(self, on: bool) -> None:
        self.cache.enable(on)
        self.head.enable(on)

    def hold(self, on: bool) -> None:
        """Captures held back (calls replay or run eagerly, uncounted) while ``on``."""
        self.cache.held = self.head.held = on

    @property
    def pool_bytes(self) -> int:
        """Cached device memory only the graphs use (their pools)."""
        return self.cache.pool_bytes + self.head.pool_bytes

    @property
    def nbytes(self) -> int:
        """Device memory the graphs hold: their pools and static buffers."""
        return self.cache.nbytes + self.head.nbytes

    @property
    def wanted(self) -> int:
        """Device memory the graphs hold, and the most one of them waits for to launch (`GraphCache._room_for`)."""
        return self.nbytes + self.cache.waiting + self.head.waiting

    def clear(self, forget: bool = False) -> None:
        """Drop every graph; ``forget``: the calls' trust too (a weight write, the release)."""
        self._pending = None
        for cache in (self.cache, self.head):
            cache.forget() if forget else cache.clear()
        self.prefetch.casts.unfix()

    def details(self) -> dict[str, int]:
        return {**self.cache.details(), "head_graphs": len(self.head), "head_graphs_refused": self.head.refused,
                "head_graph_retries": self.head.retried,
                "graph_wait_bytes": max(self.cache.waiting, self.head.waiting)}


def owner_name(owner: Owner) -> str:
    if isinstance(owner, StreamBlock):
        return owner.name
    return owner.block.name if owner.module is owner.block.module else f"{owner.block.name} part {owner.index}"

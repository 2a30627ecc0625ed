"""`GraphCache._room_for`: under cudaMallocAsync a graph's first launch waits for the driver's free
memory to cover its footprint, and the allocator's cache is emptied for it only where that can
help: where the cache's unused memory exceeds what the last emptying left by the launch's need.
The card is scripted (the CPU has neither the driver's free memory nor the allocator's cache);
the GPU check is `tests/gpu/async_allocator_check.py`."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core.transport import graph_memory, graphs

GIB = 1 << 30


class Card:
    """Free memory, the allocator's unused cache and the part of it an emptying gives back."""

    def __init__(self, free: int, cached: int = 0, releasable: int | None = None) -> None:
        self.free, self.cached = free, cached
        self.releasable = cached if releasable is None else releasable
        self.emptied = 0

    def grow_cache(self, nbytes: int) -> None:  # a freed tensor's memory stays in the cache
        self.cached += nbytes
        self.releasable += nbytes

    def empty(self) -> None:
        self.emptied += 1
        self.free, self.cached = self.free + self.releasable, self.cached - self.releasable
        self.releasable = 0


@pytest.fixture
def card(monkeypatch) -> Card:
    card = Card(free=GIB // 2)
    monkeypatch.setattr(graph_memory, "fits", lambda device, need: card.free >= need + graph_memory.LAUNCH_MARGIN)
    monkeypatch.setattr(graphs, "_cached_unused", lambda device: card.cached)
    monkeypatch.setattr(torch.cuda, "empty_cache", card.empty)
    return card


def test_a_launch_short_of_free_memory_waits_and_says_for_how_much(card: Card) -> None:
    cache = graphs.GraphCache(torch.device("cuda"), False)
    assert not cache._room_for(GIB) and cache.waiting == GIB and card.emptied == 0  # nothing cached to give back
    assert cache._room_for(0)  # no footprint (the native allocator's graphs): nothing to wait for
    cache.clear()
    assert cache.waiting == 0


def test_the_cache_is_emptied_once_a_freed_tensor_left_room_in_it(card: Card) -> None:
    cache = graphs.GraphCache(torch.device("cuda"), False)
    assert not cache._room_for(GIB)
    card.grow_cache(2 * GIB)
    assert cache._room_for(GIB) and card.emptied == 1 and card.free == GIB // 2 + 2 * GIB


def test_a_cache_that_gives_nothing_back_is_not_emptied_again_until_it_grows_by_the_need(card: Card) -> None:
    cache = graphs.GraphCache(torch.device("cuda"), False)
    card.cached = 3 * GIB  # in chunks that hold live tensors too: the driver cannot take it
    assert not cache._room_for(GIB) and card.emptied == 1
    assert not cache._room_for(GIB) and card.emptied == 1  # emptying again would give back nothing
    card.grow_cache(GIB // 2)
    assert not cache._room_for(GIB) and card.emptied == 1
    card.grow_cache(GIB // 2)  # the cache now holds the need beyond what the last emptying left
    assert cache._room_for(GIB) and card.emptied == 2

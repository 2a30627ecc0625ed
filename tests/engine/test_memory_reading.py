"""`MemoryReader.one_reading`: the allocator's counters read once for several readings (a cycle's
start reads them on the launch path), and read anew after a change the table would not show.
The table is the allocator's own call, counted; no CUDA device is needed to count it."""

import gc

import torch
from diffusers_offload.offload_core import memory
from diffusers_offload.offload_core.memory import MemoryReader

CUDA = torch.device("cuda")


def table_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    tables = iter(range(1, 1000))

    def table(device):  # each call a fresh table: a reading from a held one shows the old count
        calls.append(1)
        n = next(tables)
        return {"allocated_bytes": {"all": {"current": n, "peak": n}}, "num_alloc_retries": n, "num_ooms": 0}

    monkeypatch.setattr(memory, "_allocator_stats", table)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    return calls


def test_readings_in_one_reading_share_one_table(monkeypatch):
    calls, reader = table_calls(monkeypatch), MemoryReader()
    with reader.one_reading():
        values = [reader.allocator_retries(CUDA), reader.allocated(CUDA), reader.peak_allocated(CUDA)]
        with reader.one_reading():  # nested: the same table
            values.append(reader.allocated(CUDA))
    assert len(calls) == 1 and values == [1, 1, 1, 1]
    assert [reader.allocated(CUDA), reader.allocated(CUDA)] == [2, 3]  # outside it: a table each


def test_a_peak_reset_or_an_emptied_cache_reads_the_table_again(monkeypatch):
    calls, reader = table_calls(monkeypatch), MemoryReader()
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with reader.one_reading():
        first = reader.allocated(CUDA)
        reader.reset_peak(CUDA)
        second = reader.allocated(CUDA)
        reader.empty_cache(CUDA)
        third = reader.allocator_retries(CUDA)
    assert (first, second, third) == (1, 2, 3) and len(calls) == 3


def test_graph_pools_are_not_cached_memory_anyone_can_use(monkeypatch):
    """The allocator's cache holds a graph cache's pool (its captures' intermediates), which only its
    graphs can use: a reading's cached-unused memory leaves it out while the cache holds it, on its
    device only, and counts it again once the graphs are dropped or the cache is gone."""
    from diffusers_offload.offload_core.transport.graphs import GraphCache

    gib = 1 << 30
    monkeypatch.setattr(memory, "_allocator_stats", lambda device: {
        "reserved_bytes": {"all": {"current": 5 * gib}}, "allocated_bytes": {"all": {"current": 2 * gib}}})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (7 * gib, 80 * gib))
    reader, here, other = MemoryReader(), torch.device("cuda", 0), torch.device("cuda", 1)
    cache = GraphCache(here, enabled=False)
    assert reader.device_free(here) == (7 * gib, 3 * gib)
    cache.pool_bytes = 2 * gib  # (what a capture into its pool reserved)
    assert reader.device_free(here) == (7 * gib, gib) and reader.device_free(other) == (7 * gib, 3 * gib)
    cache.clear()
    assert reader.device_free(here) == (7 * gib, 3 * gib)
    cache.pool_bytes = 4 * gib
    assert reader.device_free(here) == (7 * gib, 0)  # never below nothing
    del cache
    gc.collect()
    assert reader.device_free(here) == (7 * gib, 3 * gib)

"""`MemoryReader.one_reading`: the allocator's counters read once for several readings (a cycle's
start reads them on the launch path), and read anew after a change the table would not show.
The table is the allocator's own call, counted; no CUDA device is needed to count it."""

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

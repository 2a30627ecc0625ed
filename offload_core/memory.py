"""Readings of host and device memory, the pin budget, and the once-per-sweep cleanup.

Every reading goes through `MemoryReader` so tests (and the planner) can script it.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil
import torch

from .host_limit import container_room
from .log import get_logger

log = get_logger("memory")


class MemoryReader:
    """Live readings; subclass (or assign attributes) to script them in tests."""

    _held: dict | None = None  # the allocator's counters, read once inside `one_reading`

    @contextmanager
    def one_reading(self) -> Iterator[None]:
        """Inside it, the allocator's counters are read once per device and every reading comes
        from that table. Why: a cycle's start reads them several times on the launch path
        (a synchronized step's first block waits for it), each read a full table from C; nothing
        inside may allocate or free what a reading should see."""
        if self._held is not None:
            yield
            return
        self._held = {}
        try:
            yield
        finally:
            self._held = None

    def _forget(self) -> None:
        """A change the held table would not show (the peak reset, the cache emptied)."""
        if self._held:
            self._held.clear()

    def _stats(self, device: torch.device) -> dict:
        held = self._held
        if held is None:
            return _allocator_stats(device)
        if device not in held:
            held[device] = _allocator_stats(device)
        return held[device]

    def host_available(self) -> int:
        """Host memory this process may still use: free RAM, within its container's limit if any."""
        free = int(psutil.virtual_memory().available)
        room = container_room()
        return free if room is None else min(free, room.room)

    def host_bound(self, available: int) -> str:
        """What bounds ``available`` (a `host_available` reading): the container's limit, or host free."""
        room = container_room()
        return room.describe() if room is not None and room.room <= available else "host free"

    def device_free(self, device: torch.device) -> tuple[int, int]:
        """(free per the driver, cached by the allocator but unused and usable by any allocation:
        not the memory set apart, `set_apart`) for a CUDA device."""
        if device.type != "cuda":
            return (0, 0)
        free, _total = torch.cuda.mem_get_info(device)
        stats = self._stats(device)
        apart = sum(reader(device) for reader in _APART.values())
        return int(free), max(_stat(stats, "reserved_bytes") - _stat(stats, "allocated_bytes") - apart, 0)

    def device_available(self, device: torch.device) -> int | None:
        """Free plus cached-unused bytes on a CUDA device; None where that cannot be read."""
        if device.type != "cuda":
            return None
        free, cached = self.device_free(device)
        return free + cached

    def peak_allocated(self, device: torch.device) -> int | None:
        """Allocator peak since the last ``reset_peak``; None where there is no allocator to read."""
        return _stat(self._stats(device), "allocated_bytes", "peak") if device.type == "cuda" else None

    def allocated(self, device: torch.device) -> int:
        return _stat(self._stats(device), "allocated_bytes") if device.type == "cuda" else 0

    def reset_peak(self, device: torch.device) -> None:
        self._forget()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def allocator_retries(self, device: torch.device) -> int:
        """PyTorch's own shortage signals: cache-flush-and-retry count plus OOMs."""
        if device.type != "cuda":
            return 0
        stats = self._stats(device)
        return int(stats.get("num_alloc_retries", 0)) + int(stats.get("num_ooms", 0))

    def pin_limit(self) -> PinLimit | None:
        """The host application's own cap on page-locked memory, if it sets one (a ComfyUI host
        reads its ``MAX_PINNED_MEMORY``); None: only free memory and ``host_ram_gb`` bound pins."""
        return None

    def empty_cache(self, device: torch.device) -> None:
        self._forget()
        if device.type == "cuda":
            torch.cuda.empty_cache()


_APART: dict[str, Callable[[torch.device], int]] = {}  # by holder: cached device bytes only it can use


def set_apart(name: str, reader: Callable[[torch.device], int]) -> None:
    """Register ``reader``: the device bytes the allocator caches for ``name`` alone (CUDA graphs'
    private pools), which no other allocation can take, so `MemoryReader.device_free` leaves them
    out of the cached memory every plan and room request counts as usable."""
    _APART[name] = reader


def _allocator_stats(device: torch.device) -> dict:
    """The caching allocator's counters, as nested dicts from one C call. Why not
    ``torch.cuda.memory_stats``: it flattens and sorts the whole table in Python, several times
    slower, and the preload reads the allocator at each forward's start, on the launch path."""
    return torch.cuda.memory_stats_as_nested_dict(device)


def _stat(stats: dict, name: str, field: str = "current") -> int:
    return int(stats.get(name, {}).get("all", {}).get(field, 0))


_ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_expandable_turned_on = False


def wants_expandable_segments(alloc_conf: str, backend: str) -> bool:
    """Whether the engine should turn expandable segments on: PyTorch's native allocator, and
    the user's allocator configuration does not choose either way."""
    return backend == "native" and "expandable_segments" not in alloc_conf


def prefer_expandable_segments(device: torch.device) -> None:
    """Turn PyTorch's expandable segments on for the rest of the process, unless the user chose
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False`` keeps them off; ComfyUI's default
    ``backend:cudaMallocAsync`` has none). Why: a video's activations of changing sizes cut the
    native allocator's fixed segments into holes none of the next sizes fits, each new segment
    flushes the cache and retries, and the preload learns that as a shortage; expandable segments
    map pages into one growing range instead (see bench/README.md)."""
    global _expandable_turned_on
    if device.type != "cuda" or _expandable_turned_on or sys.platform == "win32":  # PyTorch has none there
        return
    conf = ",".join(os.environ.get(name, "") for name in _ALLOC_CONF_VARS)
    if not wants_expandable_segments(conf, torch.cuda.get_allocator_backend()):
        return
    _set_allocator_settings("expandable_segments:True")
    _expandable_turned_on = True
    log.info("allocator: expandable segments on, so that activations of changing sizes do not fragment the "
             "cache (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False keeps them off)")


def _set_allocator_settings(settings: str) -> None:
    """The allocator setting call of this torch: the accelerator one where it exists (the CUDA one
    warns of its deprecation since torch 2.11)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (setter or torch.cuda.memory._set_allocator_settings)(settings)


@dataclass(frozen=True)
class PinLimit:
    """A host's own cap on page-locked memory (ComfyUI's ``MAX_PINNED_MEMORY`` less its own pins):
    what this pack may lock in all, and where the cap comes from, for the log."""

    nbytes: int
    source: str


@dataclass(frozen=True)
class PinVerdict:
    """How much of a component's ``need`` may be page-locked (``grant``), and which of the caps
    bound it: host memory free less the reserve, ``host_ram_gb``, the host's pin limit."""

    need: int
    available: int
    reserve: int
    grant: int = -1  # -1: the whole need (a verdict built by hand)
    limit: str = "host free less reserve"  # the cap that bound the grant
    key: tuple = field(default=(), compare=False)  # the settings it was read for (the engine's cache)

    def __post_init__(self) -> None:
        if self.grant < 0:
            object.__setattr__(self, "grant", self.need)

    @property
    def granted(self) -> bool:
        """The whole need may be pinned."""
        return self.grant >= self.need

    @property
    def word(self) -> str:
        return "granted" if self.granted else "partly granted" if self.grant > 0 else "denied"

    def describe(self) -> str:
        bound = "" if self.granted else f" (bound by {self.limit})"
        return (f"pin {self.word}: {self.grant / 2**30:.2f} of {self.need / 2**30:.2f} GiB{bound}; host free "
                f"{self.available / 2**30:.2f} GiB less reserve {self.reserve / 2**30:.2f} GiB")


def pin_budget(need: int, reader: MemoryReader, reserve: int, budget: int | None = None,
               held: int = 0) -> PinVerdict:
    """Grant pinning only against host memory free *now* less a reserve, never total memory:
    pinned pages cannot be swapped, so over-pinning pushes the host into the OOM killer. Also
    capped by ``budget`` (``host_ram_gb``) and the host's pin limit (`MemoryReader.pin_limit`),
    each less ``held``, what this process has page-locked for other components already. Grants
    what fits: the rest of the component streams through pinned staging buffers."""
    available = reader.host_available()
    rooms = {f"{reader.host_bound(available)} less reserve": available - reserve}
    if budget is not None:
        rooms[f"host_ram_gb {budget / 2**30:.2f} GiB"] = budget - held
    limit = reader.pin_limit()
    if limit is not None:
        rooms[limit.source] = limit.nbytes - held
    bound = min(rooms, key=rooms.__getitem__)
    grant = max(min(need, rooms[bound]), 0)
    return PinVerdict(need=need, available=available, reserve=reserve, grant=grant, limit=bound)


def accelerator_available() -> bool:
    return torch.cuda.is_available()


def flush_host_cache() -> None:
    """Return freed pinned buffers of PyTorch's caching host allocator to the OS."""
    if accelerator_available():
        torch._C._host_emptyCache()


def sweep_cleanup(collect: bool = True) -> None:
    """Once per sweep, not per module: gc (unless ``collect`` is off), then give cached device and
    pinned memory back."""
    if collect:
        gc.collect()
    flush_host_cache()
    if accelerator_available():
        torch.cuda.empty_cache()

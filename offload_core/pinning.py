"""Page-locking weights where they already are (``cudaHostRegister``), with process-wide accounting.

Why not ``Tensor.pin_memory()`` (what diffusers does): it allocates a second, fresh copy through
the caching host allocator, rounded up to a power of two (1.57x the weights on Wan 14B) and at
~2.3 GB/s; registering memory that is already touched runs at ~23 GB/s and costs no extra byte.
Why `PinSet.pin_all` copies weights that lie in a private file mapping (safetensors' ``load_file``
maps them) before registering them: registering such pages makes the kernel copy each one, one
page at a time, whatever the number of threads asking; threads copying into fresh memory first are
several times faster (bench/README.md, run 59).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from .log import get_logger

log = get_logger("pinning")

_lock = threading.Lock()
_registered: dict[int, int] = {}  # host pointer -> bytes, for every live registration
THREADS = min(16, os.cpu_count() or 1)  # `fresh_copies`' copying threads


def pinned_bytes() -> int:
    """Bytes this process has page-locked through this module and not yet released."""
    with _lock:
        return sum(_registered.values())


class PinSet:
    """The registrations one transport made; ``release()`` undoes exactly those."""

    def __init__(self) -> None:
        self._ptrs: list[int] = []
        self._keep: list[torch.Tensor] = []  # storages must outlive their registration

    @property
    def nbytes(self) -> int:
        with _lock:
            return sum(_registered.get(p, 0) for p in self._ptrs)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return a pinned tensor with the same values: ``tensor`` itself when its storage could be
        registered in place, else a pinned copy."""
        if not torch.cuda.is_available() or tensor.device.type != "cpu" or tensor.is_pinned():
            return tensor
        storage = tensor.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size and _register(ptr, size):
            self._ptrs.append(ptr)
            self._keep.append(tensor)
            return tensor
        return tensor.pin_memory()

    def pin_all(self, tensors: Sequence[torch.Tensor], mapped: Callable[[torch.Tensor], bool]) -> list[torch.Tensor]:
        """`pin` on each of ``tensors``, in order; those ``mapped`` says lie in a private file
        mapping are first copied into fresh memory (`fresh_copies`: each registered as it comes,
        while the next are copied). Without CUDA nothing is pinned and nothing copied: a mapped
        weight stays mapped."""
        if not torch.cuda.is_available():
            return list(tensors)
        return [self.pin(t) for t in fresh_copies(tensors, mapped)]

    def pin_weights(self, weights: Sequence[torch.Tensor], mapped: Callable[[torch.Tensor], bool]) -> None:
        """Page-lock the host data of ``weights`` (parameters, buffers) at once (`pin_all`); a
        weight whose data had to be copied holds the copy. Subclass data (GGUF's, torchao's) is
        left to the caller's `pin` of its inner tensors."""
        plain = [w for w in weights if type(w.data) is torch.Tensor and w.device.type == "cpu"]
        for w, data in zip(plain, self.pin_all([w.data for w in plain], mapped), strict=True):
            w.data = data

    def release(self) -> None:
        for ptr in self._ptrs:
            _unregister(ptr)
        self._ptrs.clear()
        self._keep.clear()


class PinGrant:
    """A pin grant used up in order: ``claim(n)`` says whether the next ``n`` bytes are pinned.
    ``nbytes`` None grants all; once a claim does not fit, later ones are refused too (the pinned
    blocks stay a prefix of the table; the rest stream through staging buffers)."""

    def __init__(self, allowed: bool, nbytes: int | None) -> None:
        self.left = nbytes if allowed else 0

    def claim(self, nbytes: int) -> bool:
        if self.left is None:
            return True
        if nbytes > self.left:
            self.left = 0
            return False
        self.left -= nbytes
        return True


def fresh_copies(tensors: Sequence[torch.Tensor], mapped: Callable[[torch.Tensor], bool],
                 threads: int = THREADS) -> Iterator[torch.Tensor]:
    """``tensors`` in order, each plain one ``mapped`` names replaced by a copy in fresh (anonymous)
    memory; ``threads`` threads copy ahead of the one reading them (a copy lets the GIL go), so
    whatever the reader does with each (`PinSet.pin_all` registers it) overlaps the copies."""
    if not any(type(t) is torch.Tensor and mapped(t) for t in tensors):
        yield from tensors
        return
    with ThreadPoolExecutor(max(1, threads)) as pool:
        yield from pool.map(lambda t: t.clone() if type(t) is torch.Tensor and mapped(t) else t, tensors)


def _register(ptr: int, size: int) -> bool:
    with _lock:
        if ptr in _registered:
            return False
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            log.debug("cudaHostRegister failed (%s) for %d bytes: pinned copy instead", err, size)
            return False
        _registered[ptr] = size
        return True


def _unregister(ptr: int) -> None:
    with _lock:
        if _registered.pop(ptr, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(ptr)


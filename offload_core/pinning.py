"""Page-locking weights where they already are (``cudaHostRegister``), with process-wide accounting.

Why not ``Tensor.pin_memory()`` (what diffusers does): it allocates a second, fresh copy through
the caching host allocator, rounded up to a power of two (1.57x the weights on Wan 14B) and at
~2.3 GB/s; registering memory that is already touched runs at ~23 GB/s and costs no extra byte.
Why `PinSet.pin_all` copies weights that lie in a private file mapping (safetensors' ``load_file``
maps them) before registering them: registering such pages makes the kernel copy each one, one
page at a time, whatever the number of threads asking; threads copying into fresh memory first are
several times faster, and into memory backed by huge pages (`host_arena`) faster again, with one
registration for all (bench/README.md, runs 59-60).
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch

from .host_pages import PAGE, drop_file_pages
from .log import get_logger

log = get_logger("pinning")

_lock = threading.Lock()
_registered: dict[int, int] = {}  # host pointer -> bytes, for every live registration
THREADS = min(16, os.cpu_count() or 1)  # `fresh_copies`' copying threads
CHUNK = 64 << 20  # bytes one copying job moves at most, so one large tensor spreads over the threads
HUGE_PAGE = 2 << 20  # where an arena starts, so huge pages cover it from its first byte
ALIGN = PAGE  # each copy's offset in an arena: a page, so that each can be page-locked alone
_arenas: set[int] = set()  # the storages `host_arena` made and still alive: their views are page-locked alone


def pinned_bytes() -> int:
    """Bytes this process has page-locked through this module and not yet released."""
    with _lock:
        return sum(_registered.values())


def is_locked(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes are page-locked: by torch's allocator or a registration covering
    its storage's start (``is_pinned``), or a registration of its own pages (a view of an arena,
    `PinSet.pin`), which ``is_pinned`` cannot see: it asks about the storage's first byte only."""
    if tensor.device.type != "cpu":
        return False
    if tensor.is_pinned():
        return True
    with _lock:
        return _registered.get(tensor.data_ptr(), 0) >= tensor.nbytes > 0


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
        registered in place (a view of an arena: its own pages, since a grant may cover only some
        of the arena's tensors), else a pinned copy."""
        if not torch.cuda.is_available() or tensor.device.type != "cpu" or is_locked(tensor):
            return tensor
        storage = tensor.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if ptr in _arenas:
            ptr, size = tensor.data_ptr(), aligned(tensor.nbytes)
        return tensor if size and self._take(ptr, size, tensor) else tensor.pin_memory()

    def pin_all(self, tensors: Sequence[torch.Tensor], mapped: Callable[[torch.Tensor], bool]) -> list[torch.Tensor]:
        """`pin` on each of ``tensors``, in order; those ``mapped`` says lie in a private file
        mapping are first copied into one fresh arena (`fresh_copies`), registered whole in one
        call (where that fails, view by view). Without CUDA nothing is pinned and nothing copied:
        a mapped weight stays mapped."""
        if not torch.cuda.is_available():
            return list(tensors)
        out = fresh_copies(tensors, mapped)
        made = next((o for o, t in zip(out, tensors, strict=True) if o is not t), None)
        if made is not None:
            storage = made.untyped_storage()
            self._take(storage.data_ptr(), storage.nbytes(), made)
        return [self.pin(t) for t in out]

    def pin_weights(self, weights: Sequence[torch.Tensor], mapped: Callable[[torch.Tensor], bool]) -> None:
        """Page-lock the host data of ``weights`` (parameters, buffers) at once (`pin_all`); a
        weight whose data had to be copied holds the copy. Subclass data (GGUF's, torchao's) is
        left to the caller's `pin` of its inner tensors."""
        plain = [w for w in weights if type(w.data) is torch.Tensor and w.device.type == "cpu"]
        for w, data in zip(plain, self.pin_all([w.data for w in plain], mapped), strict=True):
            w.data = data

    def _take(self, ptr: int, size: int, keep: torch.Tensor) -> bool:
        """Register ``size`` bytes at ``ptr`` (``keep`` holds them) as this set's; False if refused."""
        if not _register(ptr, size):
            return False
        self._ptrs.append(ptr)
        self._keep.append(keep)
        return True

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


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to whole `ALIGN` units: the room a copy takes in an arena."""
    return -(-nbytes // ALIGN) * ALIGN


def fresh_copies(tensors: Sequence[torch.Tensor], mapped: Callable[[torch.Tensor], bool],
                 threads: int = THREADS) -> list[torch.Tensor]:
    """``tensors`` in order, each plain one ``mapped`` names replaced by a copy with its values in
    one `host_arena` (views of it, contiguous), copied by ``threads`` threads in jobs of at most
    `CHUNK` bytes (a copy lets the GIL go); the others handed back as they are."""
    picked = [i for i, t in enumerate(tensors) if type(t) is torch.Tensor and mapped(t)]
    if not picked:
        return list(tensors)
    with torch.inference_mode(False):  # the copying threads run outside it: the arena must be a normal tensor
        return _copied(tensors, picked, threads)


def _copied(tensors: Sequence[torch.Tensor], picked: list[int], threads: int) -> list[torch.Tensor]:
    """`fresh_copies` for the ``picked`` indices: their arena laid out, the copies made, and the
    pages each chunk read from the file given back (`host_pages.drop_file_pages`)."""
    out = list(tensors)
    offsets = [0]
    for i in picked:
        offsets.append(offsets[-1] + aligned(tensors[i].nbytes))
    arena = host_arena(offsets[-1])
    jobs: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (into, from, give its pages back)
    for i, start in zip(picked, offsets, strict=False):
        t = tensors[i]
        out[i] = copy = arena[start:start + t.nbytes].view(t.dtype).view(t.shape)
        if not t.is_contiguous() or t.dim() == 0:
            jobs.append((copy, t, False))
            continue
        src, dst = t.reshape(-1).view(torch.uint8), copy.reshape(-1).view(torch.uint8)
        jobs += [(dst[a:a + CHUNK], src[a:a + CHUNK], True) for a in range(0, t.nbytes, CHUNK)]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        dropped = sum(pool.map(_copy, jobs))
    log.debug("%d tensors copied out of file mappings (%.2f GiB), %.2f GiB of the files' pages given back",
              len(picked), offsets[-1] / 2**30, dropped / 2**30)
    return out


def _copy(job: tuple[torch.Tensor, torch.Tensor, bool]) -> int:
    into, source, drop = job
    into.copy_(source)
    return drop_file_pages(source) if drop else 0


def host_arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh anonymous host memory (uint8), asked to be backed by huge pages where
    the kernel allows it (``madvise``) and that much RAM is free: faulted in and registered several
    times faster than 4 KiB pages; with less free, the kernel would compact memory at each fault.
    Freed when the last tensor viewing it goes. Why not torch's allocator: it takes huge pages only
    when the whole process was started with ``THP_MEM_ALLOC_ENABLE=1``."""
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_ANONYMOUS") else {}  # (Windows: none)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, **private)
    huge = hasattr(mmap, "MADV_HUGEPAGE") and psutil.virtual_memory().free >= nbytes
    if huge:
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            huge = False
    log.debug("a host arena of %.2f GiB for pinned copies, %s", nbytes / 2**30,
              "huge pages asked for" if huge else "small pages (less RAM free than that, or no huge pages here)")
    whole = torch.frombuffer(area, dtype=torch.uint8)  # (the tensor keeps the mapping alive)
    _arenas.add(whole.data_ptr())
    weakref.finalize(area, _arenas.discard, whole.data_ptr())  # (once its last view is gone)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip:skip + nbytes]


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


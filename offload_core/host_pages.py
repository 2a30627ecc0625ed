"""Giving back the pages a copy read from a private file mapping, where they still hold the file's
own bytes (Linux; elsewhere nothing is done).

Why: copying a weight out of safetensors' mapping (`pinning.fresh_copies`) maps each page it reads
into this process, and the mapping lives on while any tensor over the file does (one small one
left is enough), so those pages count in the process's RSS beside their copy: double the weights.
``MADV_DONTNEED`` unmaps them; a page the file still holds reads back unchanged at its next touch,
so no tensor's value can change. A page written since it was mapped
(a private copy: a fused LoRA, a page-locked page) would read back the file's bytes, so a range
holding one is left as it is: ``/proc/self/pagemap`` tells which pages are the file's.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4
_FILE_PAGE = 1 << 61  # pagemap: a file page (or shared anonymous), not a private copy; bit 63: present
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def drop_file_pages(t: torch.Tensor) -> int:
    """Unmap the whole pages inside ``t``'s bytes (a view of a private file mapping) when none of
    them is a private copy; the bytes unmapped (0 when left, or off Linux)."""
    start = -(-t.data_ptr() // PAGE) * PAGE
    end = (t.data_ptr() + t.nbytes) // PAGE * PAGE
    if _libc is None or end <= start or not _all_file_pages(start, end):
        return 0
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) != 0:
        return 0
    return end - start


def _all_file_pages(start: int, end: int) -> bool:
    """Whether every present page in [start, end) is a page of the file, none a private copy."""
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return False
    want = (end - start) // PAGE * 8
    try:
        raw = os.pread(fd, want, start // PAGE * 8)
    finally:
        os.close(fd)
    if len(raw) != want:
        return False
    entries = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    private = (entries < 0) & ((entries & _FILE_PAGE) == 0)  # present (bit 63, the sign) and not the file's
    return not bool(private.any())

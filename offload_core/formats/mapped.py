"""Weights memory-mapped from the safetensors files a component was loaded from (SPEC §12).

Why: a weight whose bytes in RAM are the file's bytes needs no anonymous copy; over a mapping of
the file the page cache is the store, so a model larger than free RAM still runs (its streamed
blocks are read from the page cache, or the disk, each step). The mapping is private
(``mmap.ACCESS_COPY``): an in-place write (a fused LoRA, a pinned page) makes private pages and
never reaches the file.

A tensor is mapped only where that is exact: same name in the files, same dtype (a dtype cast at
load means other bytes), same shape, contiguous, in host memory, and the file's bytes equal the
live ones (compared, so a model changed after load keeps its values). Tensors the loader already
left in a private mapping of the very file at the very offset (safetensors' own loader does for
same-dtype loads; Linux shows it in ``/proc/self/maps``) are counted and left as they are. Each
re-pointed tensor is ``torch.frombuffer`` over a Python ``mmap``: the tensor holds the buffer
export, so the mapping lives as long as any tensor over it and is unmapped after the last one.
Every file's header is checked against its size before anything is mapped: a truncated file
(a read past its end would kill the process with SIGBUS) is refused by name.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import struct
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..log import get_logger
from ..pinning import is_locked
from ..report import gib

FileRange = tuple[int, int, int, tuple[int, int]]  # a file-backed mapping: start, end, file offset, (dev, inode)

log = get_logger("mapped")

MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class MappedFileError(ValueError):
    """A safetensors file that cannot be mapped safely; the message names the file."""


@dataclass(frozen=True)
class FileTensor:
    """One tensor of a safetensors file: its bytes are ``[start, end)`` of ``file``."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass
class MappedReport:
    """What mapping did to one component: bytes re-pointed at a mapping here, bytes the loader
    had already mapped, and bytes kept in RAM by reason."""

    folder: str
    mapped_bytes: int = 0
    loader_mapped_bytes: int = 0
    kept: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    files: tuple[str, ...] = ()

    @property
    def total_mapped(self) -> int:
        return self.mapped_bytes + self.loader_mapped_bytes

    @property
    def kept_bytes(self) -> int:
        return sum(self.kept.values())

    def line(self) -> str:
        """``mapped 1.20 GiB (0.10 GiB here, 1.10 GiB by the loader), kept in RAM 0.30 GiB (...)``."""
        text = (f"mapped {gib(self.total_mapped)} from {len(self.files)} file(s) in {self.folder} "
                f"({gib(self.mapped_bytes)} re-pointed here, {gib(self.loader_mapped_bytes)} mapped by the loader)")
        if self.kept:
            why = "; ".join(f"{gib(n)}: {reason}" for reason, n in sorted(self.kept.items(), key=lambda kv: -kv[1]))
            text += f", kept in RAM {gib(self.kept_bytes)} ({why})"
        return text


# -- files ------------------------------------------------------------------------------------
def read_header(path: Path) -> dict[str, FileTensor]:
    """The tensors of one safetensors file, checked against its size (nothing is mapped yet)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise MappedFileError(f"{path} is not a safetensors file ({size} bytes, no header): download it again")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER, size - 8):
            raise MappedFileError(f"{path} is truncated or not a safetensors file (header of {length} bytes, file "
                                  f"of {size}): download it again")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise MappedFileError(f"{path} has a damaged header ({exc}): download it again") from exc
    base = 8 + length
    out: dict[str, FileTensor] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        if base + end > size:
            raise MappedFileError(f"{path} is truncated: {key} ends at byte {base + end}, the file has {size} "
                                  "bytes; download it again")
        out[key] = FileTensor(str(path), entry["dtype"], tuple(entry["shape"]), base + start, base + end)
    return out


def index_folder(folder: Path) -> dict[str, list[FileTensor]]:
    """Every tensor of the folder's safetensors files by name (shard index files and any other
    ``*.safetensors``: a variant may hold the same name; dtype and bytes pick among them)."""
    files = set(folder.glob("*.safetensors"))
    for index in folder.glob("*.safetensors.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError) as exc:
            raise MappedFileError(f"{index} cannot be read ({exc}): download it again") from exc
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise MappedFileError(f"{index} names {missing[0]}, which is missing from {folder}")
        files.update(folder / s for s in shards)
    keys: dict[str, list[FileTensor]] = defaultdict(list)
    for path in sorted(files):
        for key, tensor in read_header(path).items():
            keys[key].append(tensor)
    return keys


# -- mapping ----------------------------------------------------------------------------------
def map_from_files(module: torch.nn.Module, folder: str | os.PathLike[str] | None = None) -> MappedReport:
    """Re-point ``module``'s parameters and buffers whose bytes are the files' at a private
    mapping of ``folder``'s safetensors files (default: the folder the module was loaded from);
    the same Parameter objects stay, only their ``.data`` changes."""
    path = Path(folder) if folder is not None else source_folder(module)
    report = MappedReport(str(path) if path is not None else "-")
    if path is None or not path.is_dir():
        _keep_all(module, report, "no folder of files recorded for it")
        return report
    index = index_folder(path)  # every header checked before anything is mapped
    report.files = tuple(sorted({t.file for ts in index.values() for t in ts}))
    if not index:
        _keep_all(module, report, f"no safetensors files in {path}")
        return report
    maps = _Mappings(loader_ranges())
    for names, tensor in _tensors(module):
        _map_one(names, tensor, index, maps, report)
    return report


def _map_one(names: list[str], t: torch.Tensor, index: dict[str, list[FileTensor]], maps: _Mappings,
             report: MappedReport) -> None:
    """Map one tensor (known under ``names``), or count it in RAM under the reason."""
    nbytes = t.numel() * t.element_size()
    why = _unmappable(t)
    entries = next((index[n] for n in names if n in index), None)
    if not why and entries is None:
        why = "not in the files (made at load or renamed)"
    if not why:
        live = str(t.dtype).removeprefix("torch.")
        same = [e for e in entries if DTYPES.get(e.dtype) == t.dtype]
        shaped = [e for e in same if e.shape == tuple(t.shape)]
        if not same:
            why = f"loaded as {live} from {'/'.join(sorted({e.dtype for e in entries}))} (cast at load)"
        elif not shaped:
            why = "another shape than in the files"
        elif any(maps.loader_mapped(t, e) for e in shaped):
            report.loader_mapped_bytes += nbytes
            return
        else:
            hit = next((v for e in shaped if torch.equal(v := maps.view(e), _bytes_of(t))), None)
            if hit is None:
                why = "values differ from the files (changed after load)"
            else:
                t.data = hit.view(t.dtype).view(t.shape)
                report.mapped_bytes += nbytes
                return
    report.kept[why] += nbytes


def _unmappable(t: torch.Tensor) -> str:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return f"stored as {type(t).__name__}"
    if t.device.type != "cpu":
        return f"on {t.device}"
    if not t.is_contiguous():
        return "not contiguous"
    if t.numel() == 0:
        return "empty"
    return ""


def _tensors(module: torch.nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each distinct parameter and buffer once, with every name it has (tied weights)."""
    seen: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        if t is not None:
            seen.setdefault(id(t), ([], t))[0].append(name)
    return list(seen.values())


def _keep_all(module: torch.nn.Module, report: MappedReport, why: str) -> None:
    report.kept[why] = sum(t.numel() * t.element_size() for _n, t in _tensors(module))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class _Mappings:
    """The private mappings opened by one ``map_from_files`` call (one per file, opened at first
    use) and the loader's file-backed ranges to recognise tensors mapped already."""

    def __init__(self, loader: list[FileRange]) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._loader = loader
        self._starts = [r[0] for r in loader]
        self._ids: dict[str, tuple[int, int]] = {}

    def view(self, entry: FileTensor) -> torch.Tensor:
        mm = self._maps.get(entry.file)
        if mm is None:
            with open(entry.file, "rb") as f:
                mm = self._maps[entry.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return torch.frombuffer(mm, dtype=torch.uint8, count=entry.end - entry.start, offset=entry.start)

    def loader_mapped(self, t: torch.Tensor, entry: FileTensor) -> bool:
        """``t`` lies in a mapping of ``entry``'s file at ``entry``'s offset."""
        ptr, n = t.data_ptr(), entry.end - entry.start
        if entry.file not in self._ids:
            stat = os.stat(entry.file)
            self._ids[entry.file] = (stat.st_dev, stat.st_ino)
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return False
        lo, hi, off, file_id = self._loader[i]
        return ptr + n <= hi and file_id == self._ids[entry.file] and off + ptr - lo == entry.start


def loader_ranges() -> list[FileRange]:
    """File-backed private mappings of this process: (start, end, file offset, (dev, inode)), by
    start (mappings never overlap: a bisection finds a pointer's). Linux only; elsewhere every
    tensor is compared and re-pointed."""
    if not sys.platform.startswith("linux"):
        return []
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or parts[4] == "0" or "p" not in parts[1]:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            out.append((lo, hi, int(parts[2], 16), (os.makedev(major, minor), int(parts[4]))))
    return sorted(out)


def in_mapping(ranges: list[FileRange] | None = None) -> Callable[[torch.Tensor], bool]:
    """Whether a host tensor's bytes start in one of this process's private file mappings
    (``ranges``: its `loader_ranges`, read now when not given)."""
    spans = loader_ranges() if ranges is None else ranges
    starts = [r[0] for r in spans]

    def inside(t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return False
        ptr = t.data_ptr()
        i = bisect.bisect_right(starts, ptr) - 1
        return i >= 0 and ptr < spans[i][1]

    return inside


def mapped_bytes(module: torch.nn.Module, ranges: list[FileRange] | None = None) -> int:
    """Bytes of ``module``'s tensors resting unpinned in a private file mapping now (a tensor moved
    to a device or pinned is not counted: it no longer reads from the file). ``ranges``: this
    process's `loader_ranges`, read once for several modules."""
    inside, cuda = in_mapping(ranges), torch.cuda.is_available()
    return sum(t.numel() * t.element_size() for _names, t in _tensors(module)
               if inside(t) and not (cuda and is_locked(t)))


def source_folder(module: torch.nn.Module) -> Path | None:
    """The local folder ``module`` was loaded from (diffusers' and transformers' ``_name_or_path``,
    a str or a path, as given to ``from_pretrained``), if it still exists."""
    config = getattr(module, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(module, "name_or_path", None)
    if not isinstance(name, (str, os.PathLike)) or not str(name):
        return None
    folder = Path(name)
    return folder if folder.is_dir() else None

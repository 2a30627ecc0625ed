"""Base weights read back from the safetensors files a component was loaded from, instead of
RAM backups (SPEC §12: a rank-64 LoRA on Wan-14B would otherwise hold 15.6 GiB of copies).

Where the files are: the folder the loader read, ``config._name_or_path`` (diffusers and
transformers both record it); its ``*.safetensors.index.json`` files map keys to shards, and any
other ``*.safetensors`` there (a variant, an unsharded file) is indexed by its header. A weight is
restored from a file only if the file holds its name, with its shape, and the file's values cast
to the live dtype (``.to(dtype)``, what diffusers does at a dtype-cast load) equal the live
master on sampled rows (the first, the last and evenly spaced ones between: a cheap check that
catches another file, another variant or a model modified after load); otherwise it keeps a RAM
backup. The file's identity (size, mtime) is recorded: a file changed on disk before the restore
is refused by name instead of restoring other values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..formats.mapped import source_folder
from ..log import get_logger
from .files import LoraError, identity

log = get_logger("lora")

SAMPLED_ROWS = 8


@dataclass(frozen=True)
class FileSource:
    """Where one weight's base value is read back from."""

    file: str
    key: str
    identity: tuple[str, int, int]


class WeightFiles:
    """A component's safetensors files, opened lazily (headers only until a value is read)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._keys: dict[str, list[str]] | None = None  # key -> files holding it
        self._handles: dict[str, object] = {}

    @classmethod
    def of(cls, module: torch.nn.Module) -> WeightFiles:
        return cls(source_folder(module))

    def source(self, name: str, master: torch.Tensor) -> FileSource | None:
        """The file whose ``name`` equals ``master`` (cast to its dtype) on sampled rows, or None."""
        for file in self._index().get(name, []):
            try:
                piece = self._handle(file).get_slice(name)
                if tuple(piece.get_shape()) != tuple(master.shape):
                    continue
                if _samples_match(piece, master):
                    return FileSource(file, name, identity(file))
            except (SafetensorError, OSError, ValueError, TypeError) as exc:
                log.warning("LoRA restore: %s cannot be read (%s); %s is backed up in RAM", file, exc, name)
        return None

    def read(self, src: FileSource, dtype: torch.dtype) -> torch.Tensor:
        """The base value, as the loader made it (``.to(dtype)`` on the host)."""
        return self._handle(src.file).get_tensor(src.key).to(dtype)

    def _handle(self, file: str):
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(file, "pt", device="cpu")
        return handle

    def _index(self) -> dict[str, list[str]]:
        if self._keys is None:
            self._keys = _index_folder(self.folder) if self.folder is not None else {}
        return self._keys


def check_unchanged(sources: list[FileSource]) -> None:
    """Every file still is what it was when its values were verified (call before any write)."""
    for src in sources:
        try:
            now = identity(src.file)
        except OSError:
            now = None
        if now != src.identity:
            raise LoraError(
                f"{src.file} changed on disk since a LoRA was applied (it holds the base value of "
                f"{src.key}): the base weights cannot be restored from it; reload the model")


def _index_folder(folder: Path) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    indexed: set[Path] = set()
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            continue
        for key, shard in weight_map.items():
            path = folder / shard
            indexed.add(path)
            keys.setdefault(key, []).append(str(path))
    for path in sorted(folder.glob("*.safetensors")):
        if path in indexed:
            continue
        try:
            with safe_open(str(path), "pt", device="cpu") as f:
                names = list(f.keys())  # noqa: SIM118 (safe_open has no __iter__)
        except (SafetensorError, OSError, ValueError):
            continue
        for key in names:
            keys.setdefault(key, []).append(str(path))
    return keys


def _samples_match(piece, master: torch.Tensor) -> bool:
    if master.dim() == 0:
        return False  # a scalar: a RAM backup costs nothing
    rows = master.shape[0]
    picks = sorted({round(i * (rows - 1) / (SAMPLED_ROWS - 1)) for i in range(SAMPLED_ROWS)}) if rows > 1 else [0]
    return all(torch.equal(piece[r : r + 1].to(master.dtype), master[r : r + 1].detach().cpu()) for r in picks)

"""Measured activation peaks and learnt penalties, keyed by model and workload, kept for the
whole process.

A measure outlives the planner that took it (unload, reload, a new planner for the same
weights) and, once a file is attached, the process: the first run after a restart is then
planned from its first cycle. Each key keeps the largest peak seen: a plan must fit the worst
step of a workload, not the last one. The penalty a workload's shortages taught (what the
allocator wastes beyond the measure) is kept beside it, so a restart does not learn it again
through the same shortages (on a 12 GiB card, a 480p video's first step met two). So is the
most its CUDA graphs took (for a workload whose block calls are graphed), the room the next
run's plan leaves them before they are captured.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..log import get_logger

logger = get_logger("preload")

NEAR = 16  # workloads within 1/16 of each other share a penalty and scale a measure (`MeasureStore`)
FORMAT_VERSION = 3  # 2 added penalties, 3 graph bytes; older files are read without them


@dataclass(frozen=True)
class MeasureKey:
    model_class: str
    identity: str  # what tells two models of one class apart (weights path, hash)
    block_count: int
    total_bytes: int
    workload: int

    @property
    def model(self) -> tuple[str, str, int, int]:
        """The model part of the key (everything but the workload)."""
        return (self.model_class, self.identity, self.block_count, self.total_bytes)


class MeasureStore:
    """Peak activation bytes, penalty bytes and CUDA graph bytes per ``MeasureKey``; saved to
    ``path`` (when attached) on change."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._peaks: dict[MeasureKey, int] = {}
        self._penalties: dict[MeasureKey, int] = {}
        self._graphs: dict[MeasureKey, int] = {}
        self._path: Path | None = None
        if path is not None:
            self.attach(path)

    def attach(self, path: str | os.PathLike[str]) -> None:
        """Read the file (missing or corrupt: start from what is in memory) and save every
        later change to it."""
        self._path = Path(path)
        peaks, penalties, graphs = _read(self._path)
        for key, peak in peaks.items():
            self._peaks[key] = max(peak, self._peaks.get(key, 0))
        for key, penalty in penalties.items():
            self._penalties.setdefault(key, penalty)
        for key, nbytes in graphs.items():
            self._graphs[key] = max(nbytes, self._graphs.get(key, 0))

    def penalty(self, key: MeasureKey) -> int:
        """The workload's penalty; for one with none, the largest of the model's workloads within
        1/``NEAR`` of its size (a new prompt length: the same activations give or take a few
        tokens, met on every new prompt of a model whose workload counts text tokens)."""
        if key in self._penalties:
            return self._penalties[key]
        return max((v for k, v in self._penalties.items() if k.model == key.model and _near(k.workload, key.workload)),
                   default=0)

    def record_penalty(self, key: MeasureKey, nbytes: int) -> None:
        """The workload's penalty is now ``nbytes`` (0: none)."""
        if nbytes == self._penalties.get(key, 0):
            return
        if nbytes:
            self._penalties[key] = nbytes
        else:
            del self._penalties[key]
        if self._path is not None:
            self._save(self._path)

    def graph_bytes(self, key: MeasureKey) -> int | None:
        """The most the workload's CUDA graphs took (0: graphed, none captured yet); None when its
        block calls are not graphed (or it never ran). Unknown: the largest of the model's
        workloads within 1/``NEAR`` of its size (`penalty` says why)."""
        if key in self._graphs:
            return self._graphs[key]
        return max((v for k, v in self._graphs.items() if k.model == key.model and _near(k.workload, key.workload)),
                   default=None)

    def record_graphs(self, key: MeasureKey, nbytes: int) -> None:
        """The workload's block calls are graphed and its graphs hold ``nbytes`` now (the largest is kept)."""
        if nbytes <= self._graphs.get(key, -1):
            return
        self._graphs[key] = nbytes
        if self._path is not None:
            self._save(self._path)

    def get(self, key: MeasureKey) -> int | None:
        return self._peaks.get(key)

    def estimate(self, key: MeasureKey) -> int | None:
        """A guess for an unmeasured workload of a measured model: the measure of a workload at most
        1/``NEAR`` smaller, scaled by the square of their ratio (a new prompt length: activations grow
        at most with the square of the tokens; the nearest larger one may be a video's); else the
        measure of the nearest larger workload (an upper bound), else the largest smaller one scaled
        linearly with the workload (activations grow with the token count). None when the model has
        no measure."""
        same = {k.workload: v for k, v in self._peaks.items() if k.model == key.model}
        near = [w for w in same if 0 < w <= key.workload and _near(w, key.workload)]
        if near:
            w = max(near)
            return -(-same[w] * key.workload * key.workload // (w * w))
        larger = [w for w in same if w >= key.workload]
        if larger:
            return same[min(larger)]
        if not same:
            return None
        w = max(same)
        return same[w] * key.workload // max(w, 1)

    def record(self, key: MeasureKey, peak: int) -> None:
        if peak <= self._peaks.get(key, -1):
            return
        self._peaks[key] = peak
        if self._path is not None:
            self._save(self._path)

    def _save(self, path: Path) -> None:
        keys = list(dict.fromkeys([*self._peaks, *self._penalties, *self._graphs]))
        data = {
            "version": FORMAT_VERSION,
            "measures": [
                {**asdict(k), "peak": self._peaks.get(k), "penalty": self._penalties.get(k, 0),
                 "graphs": self._graphs.get(k)} for k in keys
            ],
        }
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("preload measures not saved to %s: %s", path, exc)


Stored = dict[MeasureKey, int]


def _read(path: Path) -> tuple[Stored, Stored, Stored]:
    """(peaks, penalties, graph bytes) saved in ``path``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("version") not in (1, 2, FORMAT_VERSION):
            raise ValueError(f"version {data.get('version')!r}")
        entries = [(_key(entry), entry) for entry in data["measures"]]
        peaks = {key: int(entry["peak"]) for key, entry in entries if entry["peak"] is not None}
        penalties = {key: int(entry.get("penalty", 0)) for key, entry in entries if entry.get("penalty")}
        graphs = {key: int(entry["graphs"]) for key, entry in entries if entry.get("graphs") is not None}
        return peaks, penalties, graphs
    except FileNotFoundError:
        return {}, {}, {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        logger.warning("preload measures in %s unreadable (%s): starting without them", path, exc)
        return {}, {}, {}


def _key(entry: dict) -> MeasureKey:
    return MeasureKey(
        str(entry["model_class"]),
        str(entry["identity"]),
        int(entry["block_count"]),
        int(entry["total_bytes"]),
        int(entry["workload"]),
    )


_PROCESS_STORE = MeasureStore()


def process_store() -> MeasureStore:
    """The store planners use unless given another; the host attaches its file to it once."""
    return _PROCESS_STORE


def _near(other: int, workload: int) -> bool:
    """``other`` lies within 1/``NEAR`` of ``workload``'s size (`MeasureStore.penalty`, `estimate`)."""
    return abs(other - workload) * NEAR <= workload

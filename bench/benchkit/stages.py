"""One pipeline call, stage by stage: a clock that opens a segment at every stage change and one
per denoise step, allocator peaks over named windows that survive the engine's own resets, and
the wrappers that time a placed pipeline's whole-module moves (h3_bench.py).

Every boundary is ``synchronize -> perf_counter``. The preload planner resets torch's peak at
every forward; it reads through ``TrackingReader``, which folds the peak into every open window
first and answers the planner from its own window, so neither reading disturbs the other.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from typing import Any

import torch

from . import GB, GiB, pack
from .measure import sync
from .models import nbytes

pack()
from diffusers_offload.offload_core import Engine  # noqa: E402
from diffusers_offload.offload_core.memory import MemoryReader  # noqa: E402
from diffusers_offload.offload_core.run.stages import AUDIO, DENOISE, IMAGE, TEXT, VIDEO  # noqa: E402

OTHER = "other"  # host work between stages: resize, tokenize, image preprocessing, latent layout, post-processing
STAGE_ORDER = (OTHER, TEXT, IMAGE, DENOISE, VIDEO, AUDIO)
log = logging.getLogger("bench")


class PeakTracker:
    """Allocator peaks over named windows that survive one another's resets: every real reset first
    folds the allocator's peak into every open window."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.windows: dict[str, list[int]] = {}

    def _fold(self) -> None:
        if not self.cuda:
            return
        a, r = torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
        for w in self.windows.values():
            w[0], w[1] = max(w[0], a), max(w[1], r)

    def mark(self, key: str) -> None:
        """Open (or restart) window ``key`` now."""
        if not self.cuda:
            self.windows[key] = [0, 0]
            return
        self._fold()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.windows[key] = [torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)]

    def peak(self, key: str) -> tuple[int, int]:
        """(allocated, reserved) peaks of window ``key`` since its mark."""
        self._fold()
        return tuple(self.windows.get(key, (0, 0)))


class TrackingReader(MemoryReader):
    """The engine's memory reader with the planner's peak window kept in the tracker."""

    def __init__(self, tracker: PeakTracker) -> None:
        self.tracker = tracker
        tracker.mark("engine")

    def reset_peak(self, device: torch.device) -> None:
        if device.type == "cuda":
            self.tracker.mark("engine")

    def peak_allocated(self, device: torch.device) -> int | None:
        return self.tracker.peak("engine")[0] if device.type == "cuda" else None


class StageClock:
    """Segments of one call: a new one at every stage change, and one per denoise step."""

    def __init__(self, device: torch.device, tracker: PeakTracker, streamer: Any) -> None:
        self.device, self.tracker, self.streamer = device, tracker, streamer
        self.segments: list[dict] = []
        self.steps: list[dict] = []
        self.moves: list[dict] = []
        self.rooms: list[dict] = []
        self.stage: str | None = None
        self.failed: str | None = None  # the stage an exception left, when an entry wrapper saw it
        self._seg: dict | None = None
        self._step: dict | None = None

    def _alloc(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _retries(self) -> int:
        """The allocator's flush-and-retries so far (a stall: every cached segment freed)."""
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)) if self.device.type == "cuda" else 0

    def enter(self, stage: str) -> None:
        """A stage boundary (announced by the bench or by a stage hook)."""
        if stage == self.stage:
            return
        sync()
        now = time.perf_counter()
        self._close_step(now)
        self._close(now)
        self.stage = stage
        self.tracker.mark("stage")
        log.info("stage: %s", stage)
        self._seg = dict(stage=stage, t0=now, units=0, alloc_start=self._alloc(), retries0=self._retries(),
                         marks=[self._mark()])

    def on_stage(self, stage: str, i: int, n: int) -> None:
        """The stage hooks' publish: one unit (layer, step, chunk...) of ``stage``."""
        self.enter(stage)
        self._seg["units"] += 1
        self._seg["of"] = n
        if stage == TEXT:  # each layer's start on the compute stream: head and vision against layers
            self._seg["marks"].append(self._mark())
        if stage == DENOISE:
            sync()
            now = time.perf_counter()
            self._close_step(now)
            self.tracker.mark("step")
            self._step = dict(step=i, of=n, t0=now)

    def _close_step(self, now: float) -> None:
        if self._step is None:
            return
        step, self._step = self._step, None
        alloc, reserved = self.tracker.peak("step")
        details = self.streamer.details() if self.streamer is not None else {}
        self.steps.append(dict(step=step["step"], of=step["of"], seconds=now - step["t0"], peak_alloc_gib=alloc / GiB,
                               peak_reserved_gib=reserved / GiB, kept=details.get("kept"), blocks=details.get("blocks"),
                               streamed_gib=details.get("streamed_per_step", 0) / GiB, plan=details.get("plan", "")))

    def _close(self, now: float) -> None:
        if self._seg is None:
            return
        seg, self._seg = self._seg, None
        alloc, reserved = self.tracker.peak("stage")
        marks = [*seg.pop("marks"), self._mark()]
        seg.update(seconds=now - seg.pop("t0"), peak_alloc=alloc, peak_reserved=reserved, alloc_end=self._alloc(),
                   alloc_retries=self._retries() - seg.pop("retries0"),
                   **(layer_timeline(marks) if seg["stage"] == TEXT else {}))
        self.segments.append(seg)

    def _mark(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def finish(self) -> None:
        sync()
        now = time.perf_counter()
        self._close_step(now)
        self._close(now)
        self.stage = None

    def stages(self) -> list[dict]:
        """Segments summed per stage, in pipeline order."""
        out: dict[str, dict] = {}
        for seg in self.segments:
            s = out.setdefault(seg["stage"], dict(stage=seg["stage"], seconds=0.0, units=0, segments=0, peak_alloc=0,
                                                  peak_reserved=0, alloc_start=seg["alloc_start"]))
            s["seconds"] += seg["seconds"]
            s["units"] += seg["units"]
            s["segments"] += 1
            s["peak_alloc"] = max(s["peak_alloc"], seg["peak_alloc"])
            s["peak_reserved"] = max(s["peak_reserved"], seg["peak_reserved"])
            s["alloc_end"] = seg["alloc_end"]
            s["alloc_retries"] = s.get("alloc_retries", 0) + seg["alloc_retries"]
            s.update({k: v for k, v in seg.items() if k.endswith("_s") or k == "slowest_layers"})  # the text layers' timeline
        return sorted(out.values(), key=lambda s: STAGE_ORDER.index(s["stage"]) if s["stage"] in STAGE_ORDER else 99)


def layer_timeline(marks: list) -> dict[str, float]:
    """From GPU events at the stage's start, each layer's start and the stage's end (synchronised
    by the caller): the time before the first layer (the non-layer part moving in, embeddings, a
    VLM's vision tower), per layer (median, max, sum) and after the last layer's start."""
    if len(marks) < 3 or marks[0] is None:
        return {}
    marks[-1].synchronize()
    gaps = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]
    per_layer = gaps[1:-1]
    layers = sorted(per_layer)
    return dict(before_layers_s=gaps[0], layer_median_s=layers[len(layers) // 2] if layers else 0.0,
                layer_max_s=max(layers, default=0.0), layers_s=sum(layers), after_last_layer_s=gaps[-1],
                slowest_layers=sorted(range(len(per_layer)), key=lambda i: -per_layer[i])[:3])


class Instruments:
    """The bench's wrappers around a placed pipeline for one run; ``remove`` restores every attribute."""

    def __init__(self, pipe: Any, engine: Engine, clock: StageClock, room: bool, headroom: int) -> None:
        self.pipe, self.engine, self.clock, self.room, self.headroom = pipe, engine, clock, room, headroom
        self.device = clock.device
        self._undo: list = []

    def install(self) -> None:
        states = self.engine.states(self.pipe)
        for name in ("vae", "audio_vae"):
            state = states.get(name)
            transport = state.transport if state is not None else None
            module = getattr(self.pipe, name)
            if transport is not None and hasattr(transport, "onload"):
                self._time_moves(name, module, transport)
            entries = {"vae": {"encode": IMAGE, "decode": VIDEO}, "audio_vae": {"decode": AUDIO}}[name]
            for entry, stage in entries.items():
                self._announce(module, entry, stage, transport)
        inner = self.pipe.text_encoder.model  # H3 calls text_encoder.model(...) directly
        handles = (inner.register_forward_pre_hook(lambda *_: self.clock.enter(TEXT)),
                   inner.register_forward_hook(lambda *_: self.clock.enter(OTHER)))
        self._undo.append(lambda: [h.remove() for h in handles])

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _announce(self, module: torch.nn.Module, entry: str, stage: str, transport: Any) -> None:
        inner = module.__dict__.get(entry)  # the on-demand transport's wrapper, when it installed one
        call = inner if inner is not None else getattr(module, entry)

        @functools.wraps(call)
        def announced(*args, **kwargs):
            self.clock.enter(stage)
            if self.room and transport is not None:
                self._make_room(stage, module, transport)
            try:
                return call(*args, **kwargs)
            except BaseException:
                self.clock.failed = self.clock.failed or stage  # before the stage hands back to ``other``
                raise
            finally:
                self.clock.enter(OTHER)

        module.__dict__[entry] = announced

        def undo() -> None:
            if inner is None:
                module.__dict__.pop(entry, None)
            else:
                module.__dict__[entry] = inner

        self._undo.append(undo)

    def _make_room(self, stage: str, module: torch.nn.Module, transport: Any) -> None:
        """What a host's memory manager does before a model moves in: free what it needs."""
        if self.device.type != "cuda" or getattr(transport, "loaded", False):
            return
        need = nbytes(module) + self.headroom
        free, cached = self.engine.memory.device_free(self.device)
        if need <= free + cached:
            return
        t0 = time.perf_counter()
        freed = self.engine.give_back(self.pipe, need - free - cached)
        torch.cuda.empty_cache()
        sync()
        self.clock.rooms.append(dict(stage=stage, component=type(module).__name__, short_gib=(need - free - cached) / GiB,
                                     freed_gib=freed / GiB, seconds=time.perf_counter() - t0,
                                     free_after_gib=torch.cuda.mem_get_info(self.device)[0] / GiB))

    def _time_moves(self, name: str, module: torch.nn.Module, transport: Any) -> None:
        for method, direction in (("onload", "in"), ("offload", "out")):
            original = getattr(transport, method)

            def timed(original=original, direction=direction) -> None:
                before = transport.loaded
                sync()
                t0 = time.perf_counter()
                try:
                    original()
                finally:
                    sync()
                    seconds = time.perf_counter() - t0
                    if transport.loaded != before or direction == "in" and not transport.loaded:
                        size = nbytes(module)
                        self.clock.moves.append(dict(component=name, direction=direction, stage=self.clock.stage,
                                                     seconds=seconds, gib=size / GiB, ok=transport.loaded != before,
                                                     gbs=size / seconds / GB if seconds > 0 else None))
                        log.info("%s moved %s: %.3f s", name, direction, seconds)

            transport.__dict__[method] = timed
            self._undo.append(lambda method=method: transport.__dict__.pop(method, None))

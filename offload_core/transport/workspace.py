"""Room for a resident encode/decode component's calls (a small VAE's decode after the denoisers).

Why: the denoisers' kept blocks are sized to their own activations, so a VAE that stays on the
device (too small to move) decodes into whatever they left free; with two denoisers (Wan 2.2
A14B) or a long video that is not enough. Each ``encode``/``decode`` call therefore first asks the
pipeline's other components (`Engine.give_back`) for its working memory beyond what is free:
its peak above the call's start, measured on an earlier call with the same inputs (SPEC §13: the
measure is this component's, never a denoiser's). An unmeasured call asks for everything the others
keep: what they keep is a speed cache the next denoise reloads at the link's speed, while running
short costs a failed call and then the same give-back. If a call runs out of memory anyway,
everything goes and the call runs once more (diffusers' VAE calls clear their caches on entry, so a
repeated call computes the same result), and from then on that call asks for everything before it
runs (a Wan 2.2 decode at 12 GiB under cudaMallocAsync ran out again after its measured room was
given back; bench/README run 39).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..log import get_logger
from ..memory import MemoryReader
from ..preload.fit import MARGIN_BASE
from .stream_hooks import retry_on_oom

log = get_logger("workspace")
EVERYTHING = 1 << 62  # asked of the others after an out-of-memory error: all they can give back


def call_key(name: str, args: tuple, kwargs: dict) -> tuple:
    """The inputs a call's working memory depends on: its entry and its tensors' shapes and dtypes."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return (name, *((tuple(t.shape), t.dtype) for t in tensors))


class Workspace:
    """The measured peaks of one component's calls and the room asked before each."""

    def __init__(self, memory: MemoryReader, device: torch.device, group: object) -> None:
        """``group``: the pipeline's on-demand group, whose ``make_room`` the engine binds at each placement."""
        self.memory, self.device, self.group = memory, device, group
        self.peaks: dict[tuple, int] = {}
        self.short: set[tuple] = set()  # calls that ran out of memory: they ask for everything
        self.ooms = 0  # out-of-memory errors met (and the call run again)
        self.depth = 0

    def wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def entered(*args, **kwargs):
            if self.depth:  # a call inside a call (a tiled decode per tile): the outer one asked
                return method(*args, **kwargs)
            key = call_key(name, args, kwargs)
            self.depth += 1
            try:
                self._ask(key)
                return retry_on_oom(lambda: self._measured(key, method, args, kwargs),
                                    lambda attempt: self._relieve(key, attempt))
            finally:
                self.depth -= 1

        return entered

    def _ask(self, key: tuple) -> None:
        need = self.peaks.get(key)
        if key in self.short or need is None:
            freed = self.make_room(EVERYTHING)
            log.info("%s %s: the pipeline's other components gave back %.2f GiB", key[0],
                     "ran out of memory before" if key in self.short else "is not measured yet", freed / 2**30)
            return
        available = self.memory.device_available(self.device)
        if available is None or available >= need + MARGIN_BASE:
            return
        freed = self.make_room(need + MARGIN_BASE - available)
        log.info("%s needs %.2f GiB of working memory, %.2f GiB free: the pipeline's other components gave back "
                 "%.2f GiB", key[0], need / 2**30, available / 2**30, freed / 2**30)

    def _measured(self, key: tuple, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        start = self.memory.allocated(self.device)
        self.memory.reset_peak(self.device)
        out = method(*args, **kwargs)
        peak = self.memory.peak_allocated(self.device)
        if peak is not None:
            self.peaks[key] = max(self.peaks.get(key, 0), peak - start)
        return out

    def make_room(self, nbytes: int) -> int:
        make_room = getattr(self.group, "make_room", None)
        return make_room(nbytes) if make_room is not None else 0

    def _relieve(self, key: tuple, attempt: int) -> bool:
        """After an out-of-memory error: once, everything the others keep on the device, and the
        call asks for everything from then on."""
        if attempt:
            return False
        self.short.add(key)
        self.ooms += 1
        freed = self.make_room(EVERYTHING)
        log.info("out of memory in an encode/decode call: the pipeline's other components gave back %.2f GiB; "
                 "running it again", freed / 2**30)
        return freed > 0

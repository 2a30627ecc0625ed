"""One pipeline call on a node: placement before it, progress and Cancel during it, its end after.

Why: a diffusers pipeline runs its own denoise loop, so none of ComfyUI's sampler callbacks
fire. A modular pipeline reports stage by stage (``offload_core.run.stages``, connected by
`stage_host`); a classic one per step (``callback_on_step_end``, turned into `StepProgress`) and,
through the same stage hooks, per text-encoder layer and decoder chunk or tile, so Cancel acts in
every stage. Both carry a preview image per denoise step when the user has previews on
(``previews.py``). Either way the call must be placed through ComfyUI's loader first and the
pipeline told that the call is over afterwards, also on an error or Cancel: `Run` does both for
every generate node, and turns an out-of-memory error the engine could not absorb into a message
naming what was on the device and what to change, with the placement released.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import comfy.utils
import torch
from server import PromptServer

from ..offload_core.oom import DeviceReading, RunOutOfMemory, out_of_memory_text, read_device
from ..offload_core.run.classic import classic_hooks
from ..offload_core.run.stages import DENOISE, StageHooks, StageHost, label
from . import previews, web_api
from .host import ENGINE, check_interrupt
from .types import PipeHandle

log = logging.getLogger("diffusers_offload.nodes")


def say(text: str, node_id: str | None) -> None:
    """Show ``text`` under the node in the UI (and in the log): notes, the current stage."""
    log.info("%s", text)
    server = PromptServer.instance
    if server is not None and node_id is not None:
        server.send_progress_text(text, node_id)


class StepProgress:
    """``callback_on_step_end`` for a pipeline call: interrupt check, then one bar tick per step,
    carrying the step's preview image when the user has previews on (`previews.StepPreviews`).

    The check comes first so that an interrupt raised while a step ran stops the pipeline before
    the next step starts. The total follows the pipeline's own timestep count when it exposes one
    (img2img strength and some schedulers run fewer steps than requested).
    """

    def __init__(self, steps: int, node_id: str | None, family: str = "other",
                 call: Mapping[str, Any] | None = None) -> None:
        self.steps = steps
        self.node_id = node_id
        self.bar = comfy.utils.ProgressBar(steps, node_id=node_id)
        self.previews = previews.StepPreviews(family, call or {}) if previews.enabled() else None

    def __call__(self, pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        check_interrupt()
        total = int(getattr(pipe, "num_timesteps", 0) or self.steps)
        image = self.previews(pipe, callback_kwargs.get("latents")) if self.previews is not None else None
        self.bar.update_absolute(step + 1, total, image)
        web_api.stage(self.node_id, "denoise", step + 1, total, pipe)
        if step + 1 == total:
            say("decoding", self.node_id)
            web_api.stage(self.node_id, "decode", pipe=pipe)
        return callback_kwargs


def stage_host(node_id: str | None, pipe: Any = None, bar: bool = True) -> StageHost:
    """Stage hooks' host: the label names the current stage (on the node and in the web panel),
    the bar follows its unit count (``bar=False``: a classic call's bar counts denoise steps only),
    and the interrupt check is ComfyUI's."""
    progress = comfy.utils.ProgressBar(1, node_id=node_id) if bar else None
    server = PromptServer.instance

    def on_stage(stage: str, i: int, n: int) -> None:
        text = label(stage, i, n)
        log.debug("%s", text)
        if server is not None and node_id is not None:
            server.send_progress_text(text, node_id)
        web_api.stage(node_id, stage, i, n, pipe, text=text)
        if n and progress is not None:
            progress.update_absolute(i, n)

    return StageHost(on_stage=on_stage, check_interrupt=check_interrupt)


@contextmanager
def _modular_hooks(pipe: Any, node_id: str | None, totals: Mapping[str, int],
                   latent_grid: tuple[int, int, int] | None) -> Iterator[StageHooks]:
    shown = nullcontext() if latent_grid is None else previews.H3Previews(
        pipe, node_id, totals.get(DENOISE, 0), latent_grid)
    with StageHooks(pipe, stage_host(node_id, pipe), totals) as hooks, shown:
        yield hooks


class Run:
    """``with Run(handle, node_id) as run: pipe(...)``: the pipeline is placed on entry (through
    ComfyUI's loader, with the handle's LoRA set) and told the call is over on exit, whether the
    call returned, failed or was cancelled. An out-of-memory error escaping the placement or the
    call is raised again as `RunOutOfMemory`, its message naming what was on the device, the free
    memory read at the start and what to change; the placement is released first."""

    def __init__(self, handle: PipeHandle, node_id: str | None) -> None:
        self.handle = handle
        self.node_id = node_id
        self.start: DeviceReading | None = None  # the device reading taken when the call started
        self._hooks = ExitStack()
        self._hooked = False

    def show(self, notes: Sequence[str]) -> str:
        """Show what was snapped or ignored under the node; the text is the node's notes output."""
        text = "\n".join(notes)
        if text:
            say(text, self.node_id)
        return text

    def step_callback(self, steps: int, call: Mapping[str, Any] | None = None) -> StepProgress:
        """The ``callback_on_step_end`` of a classic pipeline call; ``call`` (its keyword arguments:
        height, width, num_frames) lets previews unpack packed latents and sizes the decode. Inside
        the run it also installs the call's stage hooks (labels and Cancel per text-encoder layer
        and decoder chunk or tile), removed when the run ends."""
        if not self._hooked:
            self._hooked = True
            pipe = self.handle.pipe
            self._hooks.enter_context(classic_hooks(pipe, stage_host(self.node_id, pipe, bar=False), call or {}))
        return StepProgress(steps, self.node_id, getattr(self.handle, "family", "other"), call)

    def stage_hooks(self, pipe: Any, totals: Mapping[str, int],
                    latent_grid: tuple[int, int, int] | None = None) -> AbstractContextManager[Any]:
        """Stage hooks of a modular pipeline call (a context manager around the call); with
        ``latent_grid`` (latent frames, height, width of the generated video), previews too."""
        return _modular_hooks(pipe, self.node_id, totals, latent_grid)

    def __enter__(self) -> Run:
        try:
            report = self.handle.prepare()
        except torch.OutOfMemoryError as exc:
            raise self._out_of_memory(exc) from exc
        device = getattr(report, "device", "unplaced")
        self.start = read_device(ENGINE.memory, device) if device != "unplaced" else None
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self._hooks.close()
        if isinstance(exc, torch.OutOfMemoryError) and not isinstance(exc, RunOutOfMemory):
            raise self._out_of_memory(exc) from exc
        self.handle.finish()

    def _out_of_memory(self, exc: torch.OutOfMemoryError) -> RunOutOfMemory:
        """The report as the error left it, then the run's end and a release (through the patcher,
        as ComfyUI's own unload does), so that no component stays half-placed."""
        report = self.handle.report()
        for end in (self.handle.finish, lambda: self.handle.patcher.detach(unpatch_all=True)):
            try:
                end()
            except Exception:  # keep going: the user's message matters more than a failed cleanup
                log.exception("cleanup after an out-of-memory error failed")
        config = getattr(getattr(self.handle.patcher, "model", None), "config", None) or self.handle.config
        allocator = torch.cuda.get_allocator_backend() if report.device.startswith("cuda") else None
        text = out_of_memory_text(report, self.start, config.preload, allocator, exc)
        log.error("%s", text)
        return RunOutOfMemory(text)

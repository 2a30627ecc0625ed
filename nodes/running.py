"""One pipeline call on a node: placement before it, progress and Cancel during it, its end after.

Why: a diffusers pipeline runs its own denoise loop, so none of ComfyUI's sampler callbacks
fire. A classic pipeline reports per step (``callback_on_step_end``, turned into `StepProgress`);
a modular one stage by stage (``offload_core.run.stages``, connected by `stage_host`). Both carry
a preview image per denoise step when the user has previews on (``previews.py``). Either way
the call must be placed through ComfyUI's loader first and the pipeline told that the call is
over afterwards, also on an error or Cancel: `Run` does both for every generate node.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import comfy.utils
from server import PromptServer

from ..offload_core.run.stages import DENOISE, StageHooks, StageHost, label
from . import previews, web_api
from .host import check_interrupt
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


def stage_host(node_id: str | None, pipe: Any = None) -> StageHost:
    """Stage hooks' host: the bar follows the current stage's unit count, the label names it (on
    the node and in the web panel), and the interrupt check is ComfyUI's."""
    bar = comfy.utils.ProgressBar(1, node_id=node_id)
    server = PromptServer.instance

    def on_stage(stage: str, i: int, n: int) -> None:
        text = label(stage, i, n)
        log.debug("%s", text)
        if server is not None and node_id is not None:
            server.send_progress_text(text, node_id)
        web_api.stage(node_id, stage, i, n, pipe)
        if n:
            bar.update_absolute(i, n)

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
    call returned, failed or was cancelled."""

    def __init__(self, handle: PipeHandle, node_id: str | None) -> None:
        self.handle = handle
        self.node_id = node_id

    def show(self, notes: Sequence[str]) -> str:
        """Show what was snapped or ignored under the node; the text is the node's notes output."""
        text = "\n".join(notes)
        if text:
            say(text, self.node_id)
        return text

    def step_callback(self, steps: int, call: Mapping[str, Any] | None = None) -> StepProgress:
        """The ``callback_on_step_end`` of a classic pipeline call; ``call`` (its keyword arguments:
        height, width, num_frames) lets previews unpack packed latents."""
        return StepProgress(steps, self.node_id, getattr(self.handle, "family", "other"), call)

    def stage_hooks(self, pipe: Any, totals: Mapping[str, int],
                    latent_grid: tuple[int, int, int] | None = None) -> AbstractContextManager[Any]:
        """Stage hooks of a modular pipeline call (a context manager around the call); with
        ``latent_grid`` (latent frames, height, width of the generated video), previews too."""
        return _modular_hooks(pipe, self.node_id, totals, latent_grid)

    def __enter__(self) -> Run:
        self.handle.prepare()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.handle.finish()

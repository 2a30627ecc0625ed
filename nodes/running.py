"""One pipeline call on a node: placement before it, progress and Cancel during it, its end after.

Why: a diffusers pipeline runs its own denoise loop, so none of ComfyUI's sampler callbacks
fire. A classic pipeline reports per step (``callback_on_step_end``, turned into `StepProgress`);
a modular one stage by stage (``offload_core.run.stages``, connected by `stage_host`). Either way
the call must be placed through ComfyUI's loader first and the pipeline told that the call is
over afterwards, also on an error or Cancel: `Run` does both for every generate node.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import comfy.utils
from server import PromptServer

from ..offload_core.run.stages import StageHooks, StageHost, label
from . import web_api
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
    """``callback_on_step_end`` for a pipeline call: interrupt check, then one bar tick per step.

    The check comes first so that an interrupt raised while a step ran stops the pipeline before
    the next step starts. The total follows the pipeline's own timestep count when it exposes one
    (img2img strength and some schedulers run fewer steps than requested).
    """

    def __init__(self, steps: int, node_id: str | None) -> None:
        self.steps = steps
        self.node_id = node_id
        self.bar = comfy.utils.ProgressBar(steps, node_id=node_id)

    def __call__(self, pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        check_interrupt()
        total = int(getattr(pipe, "num_timesteps", 0) or self.steps)
        self.bar.update_absolute(step + 1, total)
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

    def step_callback(self, steps: int) -> StepProgress:
        """The ``callback_on_step_end`` of a classic pipeline call."""
        return StepProgress(steps, self.node_id)

    def stage_hooks(self, pipe: Any, totals: Mapping[str, int]) -> StageHooks:
        """Stage hooks of a modular pipeline call (a context manager around the call)."""
        return StageHooks(pipe, stage_host(self.node_id, pipe), totals)

    def __enter__(self) -> Run:
        self.handle.prepare()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.handle.finish()

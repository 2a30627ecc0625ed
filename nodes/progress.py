"""ComfyUI progress, stage text and interrupt for one diffusers pipeline call.

Why: a diffusers pipeline runs its own denoise loop, so none of ComfyUI's sampler callbacks fire.
The one per-step hook a classic pipeline offers is ``callback_on_step_end``; `StepProgress` turns
it into ComfyUI's progress bar and interrupt check, so the bar moves per step and Cancel stops a
run within one step. `stage_host` connects the engine's stage hooks (``offload_core.run.stages``) to
the same bar and to a label on the node, for pipelines run stage by stage (modular MiniMax-H3).
The engine stays host-free: only node files import this.
"""

from __future__ import annotations

import logging
from typing import Any

import comfy.utils
from server import PromptServer

from ..offload_core.run.stages import StageHost, label
from . import web_api
from .host import check_interrupt

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

"""ComfyUI progress, stage text and interrupt for one diffusers pipeline call.

Why: a diffusers pipeline runs its own denoise loop, so none of ComfyUI's sampler callbacks fire.
The one per-step hook a classic pipeline offers is ``callback_on_step_end``; this adapter turns
it into ComfyUI's progress bar and interrupt check, so the bar moves per step and Cancel stops a
run within one step. The engine stays host-free: only node files import this.
"""

from __future__ import annotations

import logging
from typing import Any

import comfy.model_management
import comfy.utils
from server import PromptServer

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
        comfy.model_management.throw_exception_if_processing_interrupted()
        total = int(getattr(pipe, "num_timesteps", 0) or self.steps)
        self.bar.update_absolute(step + 1, total)
        if step + 1 == total:
            say("decoding", self.node_id)
        return callback_kwargs

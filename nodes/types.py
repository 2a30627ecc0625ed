"""The pack's socket types, its shared schema pieces, and `PipeHandle`, the live value on a
DIFFUSERS_PIPE socket.

Sockets carry live Python objects (ComfyUI caches node outputs, it does not serialise them), so
a handle is the loaded pipeline itself plus the settings it is to be placed with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from comfy_api.latest import io

from ..offload_core import OffloadConfig, PlacementReport
from ..offload_core.lora import LoraSpec, activate
from .host import DiffusersPatcher

CATEGORY = "diffusers offload"

DiffusersPipe = io.Custom("DIFFUSERS_PIPE")
OffloadConfigType = io.Custom("OFFLOAD_CONFIG")
# Shared by the generate nodes: the seed range ComfyUI's own samplers take, and the notes output.
SEED_MAX = 0xFFFFFFFFFFFFFFFF
NOTES = io.String.Output("notes", display_name="notes", tooltip="What was snapped or ignored, one line each.")

# Class-name prefixes of a pipeline (or of a modular pipeline's blocks) -> family; first match.
FAMILIES: tuple[tuple[str, str], ...] = (
    ("MiniMaxH3", "minimax_h3"),
    ("LTX2", "ltx2"),
    ("Flux", "flux"),
    ("Wan", "wan"),
)


def family_of(pipe: Any) -> str:
    """``flux`` / ``wan`` / ``ltx2`` / ``minimax_h3`` / ``other``, from the pipeline's class (a
    generic ``ModularPipeline`` is told by its blocks' class)."""
    names = (type(pipe).__name__, type(getattr(pipe, "blocks", None)).__name__)
    for prefix, family in FAMILIES:
        if any(name.startswith(prefix) for name in names):
            return family
    return "other"


@dataclass(frozen=True, eq=False)
class PipeHandle:
    """A loaded pipeline and the offload settings to place it with.

    Handles made by `with_config` share the pipeline and its ComfyUI patcher, so feeding new
    settings re-places the same weights instead of loading them again. ``patcher`` is what
    ComfyUI's caches look for on an output (``.patcher``) to recognise a model.
    """

    pipe: Any = field(repr=False)
    config: OffloadConfig
    path: str
    family: str
    dtype: torch.dtype
    patcher: DiffusersPatcher = field(repr=False)
    loras: tuple[LoraSpec, ...] = ()  # this branch's LoRA set, made effective by prepare()

    def prepare(self, memory_required: int = 0) -> PlacementReport:
        """Place (or re-place, when the settings changed) before a run, through ComfyUI's
        ``load_models_gpu``; ``memory_required`` is what the run itself needs on the device.
        Then make this handle's LoRA set effective (a no-op when the weights already carry it)."""
        self.patcher.prepare(self.config, memory_required)
        activate(self.pipe, self.loras)
        return self.report()

    def finish(self) -> None:
        """End of a pipeline call (on-demand modules back to host memory)."""
        self.patcher.finish()

    def report(self) -> PlacementReport:
        return self.patcher.report()

    def with_config(self, config: OffloadConfig) -> PipeHandle:
        return dataclasses.replace(self, config=config)

    def with_lora(self, lora: LoraSpec) -> PipeHandle:
        """A view with one more LoRA; this handle (and every other branch) keeps its own set."""
        return dataclasses.replace(self, loras=(*self.loras, lora))

    def get_ram_usage(self) -> int:
        """Read by ComfyUI's RAM-pressure cache (v0.3.x) to weigh evicting this output."""
        return self.patcher.model_size()

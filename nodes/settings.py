"""Offload settings (every `OffloadConfig` option as a widget) and Apply offload settings.

Settings are a separate value on an OFFLOAD_CONFIG socket so that they can be changed on a loaded
pipeline: Apply makes a handle that shares the pipeline, and its next placement re-places the
same weights (no reload). An option set that cannot work is refused here, before anything is hooked.

`BASIC` are the options a user needs; the rest are marked advanced where this ComfyUI's inputs
take ``advanced`` (newer frontends then fold them behind the node's advanced toggle) and stay
plain widgets elsewhere. Widgets keep their historic order and required/optional split: saved
UI workflows store widget values by position.
"""

from __future__ import annotations

import inspect
from typing import Any

from comfy_api.latest import io

from ..offload_core import OffloadConfig
from ..offload_core.config import MODES
from .types import CATEGORY, DiffusersPipe, OffloadConfigType, PipeHandle
from .web_api import search_aliases

DEFAULTS = OffloadConfig()
BASIC = ("mode", "preload", "pin_memory", "on_demand_threshold_gb", "always", "never")


def takes_advanced(input_cls: type) -> bool:
    """Whether this ComfyUI's input class takes ``advanced`` (2026 trees do, v0.3.x does not)."""
    return "advanced" in inspect.signature(input_cls.__init__).parameters


def _input(input_cls: type, name: str, **options: Any) -> io.Input:
    """``input_cls(name, ...)``, marked advanced unless the option is in `BASIC` (where supported)."""
    if name not in BASIC and takes_advanced(input_cls):
        options["advanced"] = True
    return input_cls(name, **options)


def _inputs() -> list[io.Input]:
    d = DEFAULTS
    return [
        _input(io.Combo.Input, "mode", options=list(MODES), default=d.mode,
               tooltip="auto: place each component by role; model: whole components on demand; "
                       "leaf: leaf-level groups everywhere; none: all resident."),
        _input(io.Boolean.Input, "use_stream", default=d.use_stream,
               tooltip="Prefetch the next blocks on a side stream while one computes."),
        _input(io.Boolean.Input, "record_stream", default=d.record_stream,
               tooltip="Let the allocator track stream use (needs use_stream)."),
        _input(io.Boolean.Input, "pin_memory", default=d.pin_memory,
               tooltip="Page-lock streamed weights for fast copies (granted only against free host memory)."),
        _input(io.Float.Input, "pin_reserve_gb", default=d.pin_reserve_gb, min=0.0, max=1024.0, step=0.5,
               tooltip="Host memory that pinning must always leave free."),
        _input(io.Float.Input, "on_demand_threshold_gb", default=d.on_demand_threshold_gb, min=0.0, max=1024.0,
               step=0.25, tooltip="VAEs and opted-out modules smaller than this stay resident."),
        _input(io.Float.Input, "resident_floor_mb", default=d.resident_floor_mb, min=0.0, max=1e6, step=16.0,
               tooltip="Components smaller than this stay resident."),
        _input(io.String.Input, "always", default=", ".join(d.always),
               tooltip="Components (name or class) to offload whatever their size; comma separated."),
        _input(io.String.Input, "never", default=", ".join(d.never),
               tooltip="Components (name or class) kept resident on the device; comma separated; wins over always."),
        _input(io.String.Input, "preload", default=str(d.preload),
               tooltip="Denoiser blocks kept on the device: auto (fit to free VRAM), off, or a budget in GiB "
                       "such as 8."),
        _input(io.Int.Input, "prefetch_window", default=d.prefetch_window, min=1, max=16,
               tooltip="Blocks copied ahead of the one computing."),
        _input(io.String.Input, "device", default=d.device or "",
               tooltip="Device to run on, e.g. cuda:1; empty: ComfyUI's device."),
        _input(io.String.Input, "measures_path", default=d.measures_path or "",
               tooltip="File keeping preload measures across restarts; empty: ComfyUI's user folder."),
        _input(io.Boolean.Input, "stream_parts", default=d.stream_parts, optional=True,  # older workflows lack it
               tooltip="Stream denoiser blocks in parts (attention, feed-forward): smaller buffers, so more "
                       "blocks stay on a small card. Off streams each block whole."),
        # Later options are appended, optional, after stream_parts: earlier widgets keep their positions.
        _input(io.Float.Input, "prompt_cache_gb", default=d.prompt_cache_gb, min=0.0, max=1024.0, step=0.25,
               optional=True,
               tooltip="Host memory (GiB) kept for encoded prompts: a prompt encoded once is not encoded again "
                       "while the pipeline stays loaded (changing only the seed skips the text encoder). "
                       "0 turns the cache off."),
        _input(io.String.Input, "host_ram_gb", default=str(d.host_ram_gb), optional=True,
               tooltip="Host RAM (GiB) the pack may page-lock for fast copies: auto takes what is free less "
                       "pin_reserve_gb; a number such as 24 caps it further. The rest streams through small "
                       "staging buffers. Empty: auto."),
        _input(io.Boolean.Input, "cuda_graphs", default=d.cuda_graphs, optional=True,
               tooltip="Launch the denoiser's blocks, kept or streamed, as CUDA graphs (image-sized steps): "
                       "less CPU time per step. Each graph is checked against the normal forward first."),
        _input(io.Boolean.Input, "compile_blocks", default=d.compile_blocks, optional=True,
               tooltip="Run the denoiser's blocks through torch.compile where their weights are all on the card: "
                       "faster steps once compiled. The first step of each new size compiles (seconds to a "
                       "minute); outputs differ from uncompiled ones by rounding."),
    ]


class OffloadSettings(io.ComfyNode):
    """Every engine option; the defaults suit most cards, so this node is optional."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadSettings",
            **search_aliases("offload", "block swap"),
            display_name="Offload settings",
            category=CATEGORY,
            description="Offload options for a diffusers pipeline. The defaults need no tuning; connect this only "
                        "to change them. mode, preload, pin_memory, on_demand_threshold_gb, always and never are "
                        "the usual ones; the others are advanced.",
            inputs=_inputs(),
            outputs=[OffloadConfigType.Output(display_name="offload")],
        )

    @classmethod
    def execute(cls, device: str, measures_path: str, host_ram_gb: str = "auto", **options: Any) -> io.NodeOutput:
        """Widget ids are OffloadConfig's fields; an empty text field means ComfyUI's own choice
        (``host_ram_gb``: auto). Optional widgets missing from older workflows take the defaults."""
        config = OffloadConfig(device=device.strip() or None, measures_path=measures_path.strip() or None,
                               host_ram_gb=host_ram_gb.strip() or "auto", **options)
        return io.NodeOutput(config)


class ApplyOffloadSettings(io.ComfyNode):
    """New settings on an already loaded pipeline: re-placed at its next run, never reloaded."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadApplySettings",
            **search_aliases("offload", "block swap"),
            display_name="Apply offload settings",
            category=CATEGORY,
            description="Gives a loaded pipeline new offload settings without loading it again.",
            inputs=[DiffusersPipe.Input("pipe"), OffloadConfigType.Input("offload")],
            outputs=[DiffusersPipe.Output(display_name="pipe")],
        )

    @classmethod
    def execute(cls, pipe: PipeHandle, offload: OffloadConfig) -> io.NodeOutput:
        return io.NodeOutput(pipe.with_config(offload))


NODES: list[type[io.ComfyNode]] = [OffloadSettings, ApplyOffloadSettings]

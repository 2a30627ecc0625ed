"""OffloadConfig: the validated options of one placement pass.

Validated once, at construction (``replace`` constructs anew), before anything is hooked: a
combination that cannot work (``record_stream`` without streams) is refused naming the option to
change. ``preload`` is parsed here, once, into a `Policy`. The options that decide how a component
is hooked are marked ``rehook``; a component's re-placement signature is derived from them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Literal

from .preload.policy import Policy, parse_policy

Mode = Literal["auto", "model", "leaf", "none"]
MODES: tuple[str, ...] = ("auto", "model", "leaf", "none")
GB = 1024**3


class OffloadConfigError(ValueError):
    """An offload option (or combination) that cannot work; the message names what to change."""


def _parse_list(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.replace(";", ",").replace("\n", ",").split(",")
    return tuple(dict.fromkeys(v.strip() for v in value if v and v.strip()))


_GIB_TEXT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gb|gib|g)?\s*$", re.IGNORECASE)


def _parse_host_ram(value: object) -> float | str:
    """``host_ram_gb`` as ``"auto"`` or a finite number of GiB >= 0; anything else is refused."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            return "auto"
        match = _GIB_TEXT.match(text)
        if match:
            return float(match.group(1))
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    raise OffloadConfigError(
        f"host_ram_gb must be 'auto' or a finite number of GiB >= 0 (such as 24), got {value!r}")


@dataclass(frozen=True)
class OffloadConfig:
    """Options of the offload engine.

    mode: ``auto`` places by role (denoiser streamed per step, VAEs on demand, text encoders
    leaf-level); ``model`` moves every component whole on demand; ``leaf`` uses leaf-level groups
    everywhere; ``none`` keeps everything resident on the device.

    preload: ``auto``, ``off``, or a budget of kept denoiser blocks in GiB (a number, or a
    string such as ``"8"``, ``"12 GB"``, ``"800MB"``); held as a `Policy`.

    stream_parts: a streamed denoiser's blocks move in parts (their large children) instead of
    whole, so its streaming buffers are smaller and more blocks stay on a small card (see
    bench/README.md). A block's large children must use their weights only inside their own
    forward (true of diffusers' attention and feed-forward modules); off streams every block whole.

    prompt_cache_gb: host memory for the prompt-embedding cache (``run/prompt_cache.py``): a prompt
    encoded once is not encoded again while the pipeline is placed; 0 turns the cache off.

    host_ram_gb: host memory the pack may page-lock (streamed weights pinned in place and the
    pinned staging buffers the rest is copied through): ``"auto"`` grants what is free at
    placement less ``pin_reserve_gb``; a number of GiB (``24``, ``"24 GB"``) caps it further, never
    above what is free less the reserve. What it does not grant streams through staging buffers.

    cuda_graphs: a streamed denoiser's kept blocks, and the units of the blocks it streams, launch
    as CUDA graphs once they have run twice with small inputs of one shape in one place
    (``transport/block_graphs.py``), so an image-sized step is not bound by the host launching
    kernels; so do the children of its non-block part (``transport/head_graphs.py``: the copies
    of a synchronized step's start wait for them). Each graph is checked bit for bit against the
    eager forward first. A planned denoiser whose workloads' second forwards (run eagerly) the
    device, not the host, paces runs without them (``transport/graph_worth.py``): they could not speed it up
    and their memory would cost kept blocks.

    compile_blocks: a streamed denoiser's blocks run through ``torch.compile`` wherever all their
    weights are bound at their entry (kept, streamed whole, or a block's streamed parts bound
    together, which the plan keeps buffers for; ``transport/compiled.py``): fused kernels make the
    step's math faster (bench/README.md); fp8, int8 and GGUF weights are dequantised inside the
    compiled graph, and an unfused LoRA on them adds its product there. A block whose parts stream one by one (every part
    streamed, on a card too small for the plan's buffers) runs uncompiled. The first
    step of each new input shape compiles (seconds to a minute); outputs differ from uncompiled
    ones by the compiler's rounding.
    """

    mode: Mode = field(default="auto", metadata={"rehook": True})
    use_stream: bool = field(default=True, metadata={"rehook": True})
    record_stream: bool = field(default=False, metadata={"rehook": True})
    pin_memory: bool = True
    pin_reserve_gb: float = 4.0
    on_demand_threshold_gb: float = 1.0
    resident_floor_mb: float = 64.0
    always: tuple[str, ...] = field(default=())
    never: tuple[str, ...] = field(default=())
    preload: Policy = field(default="auto")  # type: ignore[assignment]  # parsed in __post_init__
    prefetch_window: int = field(default=1, metadata={"rehook": True})
    stream_parts: bool = field(default=True, metadata={"rehook": True})
    device: str | None = None
    measures_path: str | None = None
    prompt_cache_gb: float = 1.0
    host_ram_gb: float | str = "auto"
    cuda_graphs: bool = True
    compile_blocks: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "always", _parse_list(self.always))
        object.__setattr__(self, "never", _parse_list(self.never))
        try:
            object.__setattr__(self, "preload", parse_policy(self.preload))
        except ValueError as exc:
            raise OffloadConfigError(str(exc)) from None
        object.__setattr__(self, "host_ram_gb", _parse_host_ram(self.host_ram_gb))
        self._validate()

    def hooking(self) -> tuple[tuple[str, object], ...]:
        """The options that decide how a component is hooked: a change re-places it."""
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.metadata.get("rehook"))

    def _validate(self) -> None:
        if self.mode not in MODES:
            raise OffloadConfigError(f"offload mode {self.mode!r} is unknown: choose one of {', '.join(MODES)}")
        if self.record_stream and not self.use_stream:
            raise OffloadConfigError(
                "record_stream=True needs use_stream=True: turn streams on or record_stream off"
            )
        for name in ("pin_reserve_gb", "on_demand_threshold_gb", "resident_floor_mb", "prompt_cache_gb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise OffloadConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.prefetch_window < 1:
            raise OffloadConfigError(f"prefetch_window must be >= 1, got {self.prefetch_window}")
        overlap = {e.casefold() for e in self.always} & {e.casefold() for e in self.never}
        if overlap:
            raise OffloadConfigError(
                f"{', '.join(sorted(overlap))} is in both the always and the never list: keep it in one"
            )

    @property
    def pin_reserve_bytes(self) -> int:
        return int(self.pin_reserve_gb * GB)

    @property
    def resident_floor_bytes(self) -> int:
        return int(self.resident_floor_mb * 1024**2)

    @property
    def on_demand_threshold_bytes(self) -> int:
        return int(self.on_demand_threshold_gb * GB)

    @property
    def prompt_cache_bytes(self) -> int:
        return int(self.prompt_cache_gb * GB)

    @property
    def host_ram_bytes(self) -> int | None:
        """The page-lock cap of ``host_ram_gb`` in bytes; None for ``"auto"`` (free less reserve)."""
        return None if self.host_ram_gb == "auto" else int(float(self.host_ram_gb) * GB)

    def replace(self, **changes) -> OffloadConfig:
        return dataclasses.replace(self, **changes)


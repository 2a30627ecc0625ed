"""OffloadConfig: the validated options of one placement pass.

Validation happens here, before anything is hooked, so a combination that cannot work (e.g.
``record_stream`` without streams) is refused with a message naming the option to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

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


@dataclass(frozen=True)
class OffloadConfig:
    """Options of the offload engine.

    mode: ``auto`` places by role (denoiser streamed per step, VAEs on demand, text encoders
    leaf-level); ``model`` moves every component whole on demand; ``leaf`` uses leaf-level groups
    everywhere; ``none`` keeps everything resident on the device.

    stream_parts: a streamed denoiser's blocks move in parts (their large children) instead of
    whole, so its streaming buffers are smaller and more blocks stay on a small card (Wan-14B at
    12 GiB: one block more, 0.325 s a step against 0.340 s; ``bench/RESULTS.md``, run 11). A
    block's large children must use their weights only inside their own forward (true of
    diffusers' attention and feed-forward modules); off streams every block whole.
    """

    mode: Mode = "auto"
    use_stream: bool = True
    record_stream: bool = False
    pin_memory: bool = True
    pin_reserve_gb: float = 4.0
    on_demand_threshold_gb: float = 1.0
    resident_floor_mb: float = 64.0
    always: tuple[str, ...] = field(default=())
    never: tuple[str, ...] = field(default=())
    preload: str | float = "auto"
    prefetch_window: int = 1
    stream_parts: bool = True
    device: str | None = None
    measures_path: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "always", _parse_list(self.always))
        object.__setattr__(self, "never", _parse_list(self.never))
        object.__setattr__(self, "preload", _parse_preload(self.preload))
        self.validate()

    def validate(self) -> None:
        if self.mode not in MODES:
            raise OffloadConfigError(f"offload mode {self.mode!r} is unknown: choose one of {', '.join(MODES)}")
        if self.record_stream and not self.use_stream:
            raise OffloadConfigError(
                "record_stream=True needs use_stream=True: turn streams on or record_stream off"
            )
        if self.pin_reserve_gb < 0:
            raise OffloadConfigError(f"pin_reserve_gb must be >= 0, got {self.pin_reserve_gb}")
        if self.on_demand_threshold_gb < 0:
            raise OffloadConfigError(f"on_demand_threshold_gb must be >= 0, got {self.on_demand_threshold_gb}")
        if self.prefetch_window < 1:
            raise OffloadConfigError(f"prefetch_window must be >= 1, got {self.prefetch_window}")
        overlap = set(self.always) & set(self.never)
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

    def replace(self, **changes) -> OffloadConfig:
        return dataclasses.replace(self, **changes)


def _parse_preload(value: str | float | int) -> str | float:
    """``auto`` / ``off`` / a fixed budget in GiB (a number or a numeric string)."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("auto", "off"):
            return v
        try:
            value = float(v.removesuffix("gb").strip())
        except ValueError:
            raise OffloadConfigError(
                f"preload {value!r} is not understood: use 'auto', 'off' or a budget in GiB such as '8'"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise OffloadConfigError(f"preload budget must be a number of GB >= 0, got {value!r}")
    return float(value)

"""Preload policy: automatic (default), off, or a fixed budget of resident weights."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


@dataclass(frozen=True)
class Policy:
    mode: Literal["auto", "off", "fixed"]
    budget: int = 0  # bytes; "fixed" only

    def __str__(self) -> str:
        return self.mode if self.mode != "fixed" else f"{self.budget / 2**30:g} GiB"


AUTO = Policy("auto")
OFF = Policy("off")


def parse_policy(value: Policy | str | int | float) -> Policy:
    """The one parser of the preload option: ``"auto"``, ``"off"``, a number of GiB, or a
    string with a number and an optional unit (``"12"`` and ``"12 GB"`` are GiB; ``"800MB"``;
    binary multiples)."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _fixed(value, "gb", value)
    text = str(value).strip().lower()
    if text in ("auto", "off"):
        return AUTO if text == "auto" else OFF
    match = _BUDGET.match(text)
    if not match or match.group(2) not in ("", *_UNITS):
        raise ValueError(f"preload {value!r} is not understood: use 'auto', 'off' or a budget in GiB such as '12'")
    return _fixed(float(match.group(1)), match.group(2) or "gb", value)


def _fixed(amount: float, unit: str, value: object) -> Policy:
    if not math.isfinite(amount) or amount < 0:
        raise ValueError(f"preload budget {value!r} must be a finite number of GiB >= 0")
    return Policy("fixed", int(amount * _UNITS[unit]))

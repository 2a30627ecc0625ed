"""Preload policy: automatic (default), off, or a fixed budget of resident weights."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


@dataclass(frozen=True)
class Policy:
    mode: Literal["auto", "off", "fixed"]
    budget: int = 0  # bytes; "fixed" only


AUTO = Policy("auto")
OFF = Policy("off")


def parse_policy(value: Policy | str | int | float) -> Policy:
    """``"auto"``, ``"off"``, a number of bytes, or a string with a unit (``"12 GB"``,
    ``"800MB"``; binary multiples). A bare number in a string means GB: that is how people
    type a budget in a widget, while code passes bytes."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _fixed(int(value), value)
    text = str(value).strip().lower()
    if text in ("auto", "off"):
        return AUTO if text == "auto" else OFF
    match = _BUDGET.match(text)
    if not match or match.group(2) not in ("", *_UNITS):
        raise ValueError(f"preload policy {value!r}: use 'auto', 'off' or a budget such as '12 GB'")
    return _fixed(int(float(match.group(1)) * _UNITS[match.group(2) or "gb"]), value)


def _fixed(budget: int, value: object) -> Policy:
    if budget < 0:
        raise ValueError(f"preload budget {value!r} is negative")
    return Policy("fixed", budget)

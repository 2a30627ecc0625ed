"""Process-wide registry of planners, so that one model's activity ends the others' cycles.

A cycle's measure is the allocator peak since it began; once another model loads or runs, that
peak would include the other model's weights and activations, so the open cycle is closed
without a measure.
"""

from __future__ import annotations

import weakref
from typing import Protocol


class _Cycled(Protocol):
    def end_cycle(self) -> None: ...


_planners: weakref.WeakSet[_Cycled] = weakref.WeakSet()


def register(planner: _Cycled) -> None:
    _planners.add(planner)


def close_cycles(keep: _Cycled | None = None) -> None:
    """Close every registered planner's open cycle without a measure, except ``keep``'s."""
    for planner in list(_planners):
        if planner is not keep:
            planner.end_cycle()


def notify_model_load() -> None:
    """Any model is about to take device memory (the host calls this on every load it sees)."""
    close_cycles()

"""Penalty: bytes a workload's fit must leave free because a plan that "fitted" still ran short.

The measure misses what the allocator wastes (fragmentation, other processes), so shortages
teach a correction. It decays so that a transient shortage does not cost speed forever, but
decays more slowly each time a decrease proved premature (a shortage right after it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .fit import MIB

START_PATIENCE = 8  # clean cycles before a penalty halves
MAX_PATIENCE = 1024
TINY = 64 * MIB  # a penalty below this is noise: dropped when it decays


@dataclass
class Penalty:
    bytes: int = 0
    patience: int = START_PATIENCE
    clean: int = 0  # clean cycles since the last shortage or decrease
    just_decreased: bool = False  # no cycle has completed since the last decrease

    def add(self, released: int) -> None:
        """A shortage released ``released`` bytes of preloaded blocks."""
        if self.just_decreased:
            self.patience = min(2 * self.patience, MAX_PATIENCE)
        self.bytes += released
        self.clean = 0
        self.just_decreased = False

    def close_cycle(self, clean: bool) -> None:
        """A cycle of this workload ended; ``clean``: it saw no shortage."""
        if not clean:
            return
        self.just_decreased = False
        if self.bytes == 0:
            return
        self.clean += 1
        if self.clean >= self.patience:
            halved = self.bytes // 2
            self.bytes = halved if halved >= TINY else 0
            self.clean = 0
            self.just_decreased = True

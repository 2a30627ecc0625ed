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

    def learn(self, planned: int, needed: int, released: int, budget: int | None) -> None:
        """A plan of ``planned`` device bytes ran short and ``released`` went: the penalty rises until
        the cycle's ``budget`` lands below that plan by the shortfall (``needed``, else half of what
        went: midway between the plan that ran short and the one left, which a budget only just
        holding it would lose to the next run's drift). A plan over its penalised budget (room lent
        by an idle denoiser) adds the shortfall; without the cycle's budget, what went is added."""
        shortfall = max(needed, released // 2)
        if budget is None:
            self.add(released)
        elif planned > budget - self.bytes:
            self.add(shortfall)
        else:
            self.add(budget - planned + shortfall - self.bytes)

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

"""Find a denoiser's block stacks ("towers") and the blocks the streamer moves.

A tower is a ModuleList of repeated blocks (the model's ``_repeated_blocks`` classes, else
same-class entries). Short stacks (under 1/8 of the largest tower's bytes, e.g. H3's token
refiner) are not towers: they stay with the resident non-block part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..components import module_bytes


@dataclass(frozen=True)
class Tower:
    name: str
    blocks: tuple[torch.nn.Module, ...]
    nbytes: int


def find_towers(model: torch.nn.Module) -> list[Tower]:
    repeated = set(getattr(type(model), "_repeated_blocks", None) or ())
    towers: list[Tower] = []
    claimed: set[int] = set()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2 or id(module) in claimed:
            continue
        classes = {type(b).__name__ for b in module}
        if len(classes) != 1 or (repeated and not classes & repeated):
            continue
        towers.append(Tower(name, tuple(module), sum(module_bytes(b) for b in module)))
        claimed.update(id(m) for b in module for m in b.modules())
    if not towers:
        return []
    largest = max(t.nbytes for t in towers)
    return [t for t in towers if t.nbytes * 8 >= largest]

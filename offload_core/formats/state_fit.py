"""A state dict against the empty model it is assigned into: the keys it lacks or adds and the
shapes it gets wrong (every single-file loader refuses a file that does not fill its model
exactly, naming them), and the modules diffusers keeps in float32, as its ``from_pretrained`` does.
"""

from __future__ import annotations

import torch


def mismatch(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[str]]:
    """(keys ``state`` lacks, keys it adds, ``key shape vs expected shape`` of those of another shape)."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
             if k in state and tuple(state[k].shape) != tuple(v.shape)]
    return missing, unexpected, wrong


def mismatch_text(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> str | None:
    """`mismatch` in a few words, None when ``state`` fills the model exactly."""
    missing, unexpected, wrong = mismatch(expected, state)
    if not (missing or unexpected or wrong):
        return None
    return f"missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes {wrong[:3]}"


def keeps_fp32(cls: type, key: str) -> bool:
    """Whether diffusers keeps ``key`` of a ``cls`` model in float32 (a dotted part of it is one of
    the class's ``_keep_in_fp32_modules``)."""
    return any(m in key.split(".") for m in getattr(cls, "_keep_in_fp32_modules", None) or ())

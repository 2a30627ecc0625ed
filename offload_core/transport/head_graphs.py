"""CUDA graphs for a streamed denoiser's non-block part: each direct child outside its block
towers (Wan's rope, patch embedding, condition embedder, output norm and projection) launches as
one graph once its call has run twice with inputs of one signature (`graphs.py`: static inputs,
fresh outputs, trusted after a bit-exact check replay, dropped at a weight write).

Why: where the host waits for each step's end, the copy engine waits at the next step's start
until the first streamed block is released, and before that block the host launches the
non-block part op by op (bench/README.md, run 43). Its weights stay resident, so one place is
all a graph's key needs. A call whose outputs exceed the input limit (a video's) stays eager:
there the math bounds the step, and the static outputs would cost memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers.hooks import ModelHook

from .call_keys import INPUT_LIMIT, describe_value
from .graphs import SIGNATURES, CallGraph, GraphCache


class HeadGraphHook(ModelHook):
    """On one child of the non-block part: its graph replayed in place of its forward where the
    cache has a trusted one for this call, else its forward, captured after it when asked."""

    def __init__(self, cache: GraphCache, name: str, notify: Callable[[str], object]) -> None:
        super().__init__()
        self.cache, self.name, self.notify = cache, name, notify
        self.owner = (("head", name), ())  # (what is called, where its weights lie: always here)

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        plan = self.cache.plan(self.owner, args, kwargs) if self.cache.enabled else None
        if type(plan) is CallGraph:
            return plan.replay()
        output = forward(*args, **kwargs)
        if plan is GraphCache.CAPTURE and _nbytes(output) <= INPUT_LIMIT:
            self.notify("capturing")  # (the listeners: a capture's allocations are not the forward's)
            self.cache.capture(self.owner, self.name, forward, args, kwargs, output, [])
            self.notify("captured")
        return output


def graph_head(model: torch.nn.Module, tower_ids: set[int], cache: GraphCache,
               hook: Callable[[torch.nn.Module, ModelHook], object], notify: Callable[[str], object]) -> None:
    """A `HeadGraphHook` on each child of the non-block part (`head_children`), and room in
    ``cache`` for two input signatures a child (a batch with and without guidance): fewer would
    drop every graph each forward where the part has many children (H3 has ten, LTX-2 eighteen)."""
    children = head_children(model, tower_ids)
    cache.signatures = max(SIGNATURES, 2 * len(children))
    for name, child in children:
        hook(child, HeadGraphHook(cache, f"{type(model).__name__} {name}", notify))


def head_children(model: torch.nn.Module, tower_ids: set[int]) -> list[tuple[str, torch.nn.Module]]:
    """The model's direct children that hold no tower block (ids ``tower_ids``) and are no tower
    themselves: the non-block part, child by child."""
    return [(name, child) for name, child in model.named_children()
            if not any(id(m) in tower_ids for m in child.modules())]


def _nbytes(output: object) -> int:
    tensors: list[torch.Tensor] = []
    describe_value(output, tensors)
    return sum(t.nbytes for t in tensors)

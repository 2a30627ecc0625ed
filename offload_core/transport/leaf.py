"""Leaf-level groups through diffusers' own group offloading (text encoders and the rest).

Leaf hooks sit on every leaf module, so a pipeline that calls an inner model directly (MiniMax-H3
calls ``text_encoder.model(...)``) still onloads. Without streams nothing is pinned. The only
module of the engine that reads diffusers' group internals (``masters``). Leaf groups hold at most
one layer on the device, only while it runs: nothing to give back. With streams diffusers pins a
copy of every weight and leaves the module's tensors on those copies: a release puts them back in
pageable memory and empties PyTorch's pinned host cache, so no pinned RAM outlives the placement.
torchao weights (tensor subclasses) ride these groups: diffusers swaps them whole
(``swap_tensors``), and a release unpins their inner tensors and swaps them back the same way.
"""

from __future__ import annotations

import torch
from diffusers.hooks import apply_group_offloading

from ..formats.torchao import inner_tensors, is_wrapper, map_inner, storage_bytes
from ..memory import flush_host_cache
from ..pinning import is_locked
from ..state import REGISTRY
from .base import (
    DIFFUSERS_GROUP_HOOKS,
    MARKER,
    Masters,
    TransportBase,
    TransportContext,
    own_registries,
    strip_hooks,
)
from .moves import bytes_on, host_tensors, module_bytes, move_module, put


class LeafGroupTransport(TransportBase):
    name = "leaf"

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.module: torch.nn.Module | None = None

    def apply(self, module: torch.nn.Module) -> None:
        self.module = module
        move_module(module, self.ctx.offload_device)
        own_registries(module)
        apply_group_offloading(
            module,
            onload_device=self.ctx.onload_device,
            offload_device=self.ctx.offload_device,
            offload_type="leaf_level",
            use_stream=self.ctx.streams,
            record_stream=self.ctx.record_stream,
        )

    def remove(self, module: torch.nn.Module) -> None:
        strip_hooks(module, DIFFUSERS_GROUP_HOOKS)
        move_module(module, self.ctx.offload_device)
        if self.ctx.streams:
            unpin(module)
            flush_host_cache()  # what the groups' copies held (the engine's sweep collects any left in cycles)
        self.module = None

    def device_bytes(self) -> int:
        if self.module is None or self.ctx.onload_device == self.ctx.offload_device:
            return 0
        return bytes_on(self.module, self.ctx.onload_device)

    def pinned_bytes(self) -> int:
        if self.module is None or not self.ctx.streams:
            return 0
        return sum(
            i.numel() * i.element_size()
            for t in self.module.parameters()
            for i in inner_tensors(t)
            if _pinned(i)
        )

    def masters(self) -> Masters:
        """diffusers keeps a CPU copy of each weight of a group it streams (``cpu_param_dict``):
        onloads read from it."""
        out: Masters = {}
        for sub in self.module.modules() if self.module is not None else ():
            hook = getattr(sub, REGISTRY, None)
            group = getattr(hook.hooks.get(MARKER), "group", None) if hook is not None else None
            for tensor, cpu in (getattr(group, "cpu_param_dict", None) or {}).items():
                out.setdefault(id(tensor), []).append(cpu)
        return out

    def run_bytes(self) -> int:
        """The largest leaf, on the device while it runs."""
        if self.module is None:
            return 0
        return max((module_bytes(m) for m in self.module.modules() if not list(m.children())), default=0)

    def details(self) -> dict[str, object]:
        return {"streams": self.ctx.streams}


def unpin(module: torch.nn.Module) -> int:
    """Move every tensor of ``module`` that lies in pinned host memory to a pageable copy (same
    Parameter objects; a subclass weight rebuilt from pageable copies of its pinned inner tensors and
    swapped in whole); the pinned buffers go back to PyTorch's host cache. Returns the bytes moved."""
    moved = 0
    for owner, name, is_param, t in host_tensors(module):
        copy = map_inner(t, _pageable) if is_wrapper(t) else _pageable(t)
        if copy is not t:
            moved += storage_bytes(copy)
            put(owner, name, is_param, copy)
    return moved


def _pageable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when pageable, else a pageable copy."""
    return torch.empty_like(t, device="cpu", pin_memory=False).copy_(t) if _pinned(t) else t


def _pinned(t: torch.Tensor) -> bool:
    try:
        return is_locked(t)
    except Exception:
        return False

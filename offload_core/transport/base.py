"""The transport interface and the hook plumbing the transports share.

Hooks go through diffusers' per-module ``HookRegistry`` (one small hook class per feature, install
and remove symmetric). The marker hook sits under diffusers' own ``group_offloading`` name on the
top-level module, so diffusers' device queries (``pipe._execution_device``, ``model.device``) report
the onload device and its ``ModelMixin.to()`` guard warns instead of moving a managed module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.group_offloading import (
    _GROUP_OFFLOADING,
    _LAYER_EXECUTION_TRACKER,
    _LAZY_PREFETCH_GROUP_OFFLOADING,
)

from ..memory import MemoryReader

DIFFUSERS_GROUP_HOOKS = (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING)
MARKER = _GROUP_OFFLOADING
STREAM_HOOK = "diffusers_offload_stream"
ON_DEMAND_HOOK = "diffusers_offload_on_demand"
OUR_HOOKS = (STREAM_HOOK, ON_DEMAND_HOOK)


@dataclass
class TransportContext:
    """What a transport needs besides the module: devices, stream/pin decisions, readings."""

    onload_device: torch.device
    offload_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    use_stream: bool = False
    record_stream: bool = False
    pin: bool = False
    prefetch_window: int = 1
    stream_parts: bool = False  # denoiser blocks stream in parts (their large children)
    memory: MemoryReader = field(default_factory=MemoryReader)
    preload: str | float = "off"
    owner: object | None = None  # the pipeline-level group (on-demand eviction peers)


class Transport(Protocol):
    name: str

    def apply(self, module: torch.nn.Module) -> None: ...

    def remove(self, module: torch.nn.Module) -> None: ...

    def device_bytes(self) -> int:
        """Bytes of this component's weights on the onload device right now."""
        ...

    def pinned_bytes(self) -> int: ...

    def give_back(self, nbytes: int) -> int:
        """Free up to ``nbytes`` of device memory without unhooking; return what was freed."""
        ...

    def run_bytes(self) -> int:
        """Device bytes a run needs for this component beyond what it holds now."""
        ...

    def details(self) -> dict[str, object]: ...


@dataclass
class _MarkerConfig:
    onload_device: torch.device


class MarkerHook(ModelHook):
    """Marks a module as managed for diffusers' own checks; optionally calls ``on_enter``."""

    def __init__(self, onload_device: torch.device, on_enter=None, on_exit=None) -> None:
        super().__init__()
        self.config = _MarkerConfig(onload_device)
        self._on_enter = on_enter
        self._on_exit = on_exit

    def pre_forward(self, module, *args, **kwargs):
        if self._on_enter is not None:
            self._on_enter()
        return args, kwargs

    def post_forward(self, module, output):
        if self._on_exit is not None:
            self._on_exit()
        return output


def add_hook(module: torch.nn.Module, hook: ModelHook, name: str) -> None:
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)


def remove_hook(module: torch.nn.Module, name: str) -> None:
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None:
        registry.remove_hook(name, recurse=False)
        _drop_empty_registry(module)


def strip_hooks(root: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Remove the named hooks from every module under ``root`` (inner models of wrappers too)."""
    for module in root.modules():
        for name in names:
            remove_hook(module, name)


def hook_names(module: torch.nn.Module) -> list[str]:
    registry = getattr(module, "_diffusers_hook", None)
    return list(registry.hooks) if registry is not None else []


def _drop_empty_registry(module: torch.nn.Module) -> None:
    """An empty registry and the forward it left as an instance attribute are dropped, so a
    released module is indistinguishable from a never-hooked one."""
    registry = module.__dict__.get("_diffusers_hook")
    if registry is None or registry.hooks:
        return
    del module._diffusers_hook
    fwd = module.__dict__.get("forward")
    if fwd is not None and getattr(fwd, "__func__", None) is type(module).forward:
        del module.forward

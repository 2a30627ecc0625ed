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

from ..config import OffloadConfig
from ..memory import MemoryReader
from ..state import (
    DIFFUSERS_GROUP_HOOKS,
    MARKER,
    ON_DEMAND_HOOK,
    OUR_HOOKS,
    OWN_REGISTRY,
    REGISTRY,
    STREAM_HOOK,
    is_ours,
)

__all__ = ["DIFFUSERS_GROUP_HOOKS", "MARKER", "ON_DEMAND_HOOK", "OUR_HOOKS", "STREAM_HOOK", "Masters",
           "Transport", "TransportBase", "TransportContext", "add_hook", "remove_hook", "strip_hooks"]

Masters = dict[int, list[torch.Tensor]]  # id(parameter) -> the copies its onloads read from


@dataclass
class TransportContext:
    """What a transport needs besides the module: the settings, and the engine's decisions for
    this component (devices, whether pinning and the side stream were granted)."""

    onload_device: torch.device
    config: OffloadConfig = field(default_factory=OffloadConfig)
    streams: bool = False  # side-stream prefetch (an accelerator; unpinned weights go through staging buffers)
    pin: bool = False
    pin_bytes: int | None = None  # the most a transport may page-lock (None: all it holds, when ``pin``)
    memory: MemoryReader = field(default_factory=MemoryReader)
    owner: object | None = None  # the pipeline-level group (on-demand eviction peers)
    offload_device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def record_stream(self) -> bool:
        return self.config.record_stream and self.streams

    @property
    def prefetch_window(self) -> int:
        return self.config.prefetch_window

    @property
    def stream_parts(self) -> bool:
        return self.config.stream_parts


class Transport(Protocol):
    """How one component's weights move. ``apply`` and ``remove`` are exactly symmetric."""

    name: str

    def apply(self, module: torch.nn.Module) -> None: ...

    def remove(self, module: torch.nn.Module) -> None: ...

    def retune(self, config: OffloadConfig) -> None:
        """Settings that need no re-hooking changed (the preload policy)."""

    def after_run(self) -> None:
        """A pipeline call ended: drop what only that call needed."""

    def give_back(self, nbytes: int) -> int:
        """Free up to ``nbytes`` of device memory without unhooking; return what was freed."""

    def offload_idle(self) -> bool:
        """Force sweep: weights resting on the device while idle go back; True when any moved."""

    def masters(self) -> Masters:
        """The copies each parameter is loaded from besides its live ``.data`` (masters first):
        a weight write must reach them all."""

    def before_write(self) -> None:
        """Weights are about to be written in place: drop copies made ahead of use."""

    def self_cast(self) -> set[int]:
        """Ids of the fp8 weights this transport dequantises itself (the others go through a
        dequantising hook per layer, `dequant.py`)."""

    def device_bytes(self) -> int:
        """Bytes of this component's weights on the onload device right now."""

    def pinned_bytes(self) -> int: ...

    def run_bytes(self) -> int:
        """Device bytes a run needs for this component beyond what it holds now."""

    def details(self) -> dict[str, object]: ...


class TransportBase:
    """The protocol's defaults, for transports that have nothing to do there."""

    name = "base"

    def retune(self, config: OffloadConfig) -> None:
        return None

    def after_run(self) -> None:
        return None

    def give_back(self, nbytes: int) -> int:
        return 0

    def offload_idle(self) -> bool:
        return False

    def masters(self) -> Masters:
        return {}

    def before_write(self) -> None:
        return None

    def self_cast(self) -> set[int]:
        return set()

    def pinned_bytes(self) -> int:
        return 0

    def run_bytes(self) -> int:
        return 0

    def details(self) -> dict[str, object]:
        return {}


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
    own_registries(module, recurse=False)
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)


def own_registries(root: torch.nn.Module, recurse: bool = True) -> None:
    """Note the modules under ``root`` that have no hook registry yet: a registry made there
    (by us, or by diffusers' group offloading on our behalf) is dropped once empty."""
    for module in root.modules() if recurse else (root,):
        if REGISTRY not in vars(module):
            OWN_REGISTRY.set(module, True)


def remove_hook(module: torch.nn.Module, name: str) -> None:
    """Our hook ``name`` off ``module`` (a user's hook under a name we share stays)."""
    registry = getattr(module, REGISTRY, None)
    if registry is not None and is_ours(name, registry.get_hook(name)):
        registry.remove_hook(name, recurse=False)
        _drop_empty_registry(module)


def strip_hooks(root: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Remove the named hooks from every module under ``root`` (inner models of wrappers too)."""
    for module in root.modules():
        for name in names:
            remove_hook(module, name)
        OWN_REGISTRY.pop(module)  # dropped with it, or it holds others' hooks now: theirs


def _drop_empty_registry(module: torch.nn.Module) -> None:
    """A registry we made, once empty, is dropped with the forward it left as an instance
    attribute, so a released module is indistinguishable from a never-hooked one (a registry
    diffusers made itself stays)."""
    registry = module.__dict__.get(REGISTRY)
    if registry is None or registry.hooks:
        return
    if OWN_REGISTRY.pop(module):
        delattr(module, REGISTRY)
    fwd = module.__dict__.get("forward")
    if fwd is not None and getattr(fwd, "__func__", None) is type(module).forward:
        del module.forward

"""Everything the engine attaches to user objects (modules and pipelines), owned in one place.

The engine keeps its state on the user's own objects, so that a pipeline shared by several hosts
sees one truth and the state dies with the object. Each attribute is a `Key` declared here; the
hook names the transports register in diffusers' ``HookRegistry``, diffusers' forward-hook bridge
(``_hf_hook``, which ``encode``/``decode`` call) and the wrapped entry methods are declared and
installed here too. `leftovers` lists whatever of ours is still on a module: after a release it
is empty but for the keys marked ``kept`` (see `KEPT_ON_PURPOSE`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from diffusers.hooks.group_offloading import (
    _GROUP_OFFLOADING,
    _LAYER_EXECUTION_TRACKER,
    _LAZY_PREFETCH_GROUP_OFFLOADING,
)

T = TypeVar("T")
PREFIX = "_diffusers_offload_"
_KEYS: list[Key] = []


class Key(Generic[T]):
    """One attribute the engine keeps on a user object (in its ``__dict__``, bypassing
    ``nn.Module.__setattr__`` and diffusers' config-registering ``__setattr__``)."""

    def __init__(self, name: str, kept: bool = False) -> None:
        self.attr = PREFIX + name
        self.kept = kept
        _KEYS.append(self)

    def get(self, obj: object) -> T | None:
        return vars(obj).get(self.attr)

    def set(self, obj: object, value: T) -> None:
        vars(obj)[self.attr] = value

    def pop(self, obj: object) -> T | None:
        return vars(obj).pop(self.attr, None)

    def __repr__(self) -> str:
        return f"Key({self.attr!r})"


COMPONENT = Key("state")  # ComponentState: signature, transport, role decision, facts
APPLYING = Key("applying")  # the sentinel of an apply in progress
PIN_VERDICT = Key("pin_verdict")  # cached: a granted pin lowers the reading it was granted against
PIPELINE = Key("pipeline")  # PipelineState, on the pipeline object
OWN_REGISTRY = Key("own_registry")  # the module's diffusers HookRegistry was made by us
PLANNER = Key("planner", kept=True)  # preload measures, penalties, blocks kept at unload
LORA = Key("lora", kept=True)  # the LoRA set a component carries and its base-weight backups
LORA_REPORT = Key("lora_report", kept=True)  # the LoRA path a component took, for the report
PROMPT_CACHE = Key("prompt_cache")  # run.prompt_cache.PromptCache, on the pipeline object
BLOCK_CLASS = Key("block_class")  # a modular block's own class, while a caching subclass stands in
FP8 = Key("fp8", kept=True)  # formats.fp8.Fp8Table: the model's fp8 weights and scales (set by a loader)
COMPILED = Key("compiled", kept=True)  # the model's compiled block forwards (transport/compiled.py)

KEPT_ON_PURPOSE = {
    PLANNER.attr: "the preload planner survives a release so that a reload plans from its measures",
    LORA.attr: "a LoRA set stays until it is cleared (fused weights' restore sources; unfused layers' factors, "
               "whose hooks a teardown strips and the next activation re-attaches)",
    LORA_REPORT.attr: "goes with the LoRA set",
    FP8.attr: "the weights' storage format, set by the loader: it lives as long as the weights",
    COMPILED.attr: "a re-placement runs what was compiled for the model instead of compiling it again",
}

# Hooks in diffusers' per-module HookRegistry. The marker sits under diffusers' own
# ``group_offloading`` name, so diffusers' device queries and ``ModelMixin.to()`` guard see a
# managed module.
MARKER = _GROUP_OFFLOADING
STREAM_HOOK = "diffusers_offload_stream"
ON_DEMAND_HOOK = "diffusers_offload_on_demand"
# The fp8 dequantising hook sits under diffusers' ``layerwise_casting`` name, for the same reason:
# diffusers' ``get_parameter_dtype`` then answers its ``compute_dtype``, not the stored fp8 (models
# cast their inputs to it: MiniMax-H3's text and audio projections).
DEQUANT_HOOK = "layerwise_casting"
LORA_HOOK = "diffusers_offload_lora"  # an unfused LoRA's low-rank delta on a quantized layer
OUR_HOOKS = (STREAM_HOOK, ON_DEMAND_HOOK, DEQUANT_HOOK, LORA_HOOK)
SHARED_NAMES = (DEQUANT_HOOK,)  # a user's own layerwise casting sits there too: ours when marked
OURS = "_diffusers_offload_hook"  # the class attribute marking our hooks under a shared name


def is_ours(name: str, hook: object) -> bool:
    """Whether the hook registered as ``name`` is the pack's (any under a name only we use)."""
    return name not in SHARED_NAMES or getattr(hook, OURS, False)

DIFFUSERS_GROUP_HOOKS = (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING)
REGISTRY = "_diffusers_hook"


def hooks_of(module: torch.nn.Module) -> dict[str, object]:
    """The diffusers hooks on ``module`` itself, by name (empty without a registry)."""
    return getattr(vars(module).get(REGISTRY), "hooks", {})
BRIDGE = "_hf_hook"
_WRAPPED = "__diffusers_offload_entry__"


class Bridge:
    """Stands in ``module._hf_hook`` for diffusers' forward-hook bridge: ``encode``/``decode``
    decorated with ``apply_forward_hook`` call ``pre_forward`` before they run."""

    def __init__(self, on_enter: Callable[[], None], execution_device: torch.device) -> None:
        self.on_enter = on_enter
        self.execution_device = execution_device

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.on_enter()
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return output


def install_bridge(module: torch.nn.Module, on_enter: Callable[[], None], device: torch.device) -> None:
    if vars(module).get(BRIDGE) is not None:
        raise ValueError(
            f"{type(module).__name__} already carries an accelerate offload hook (_hf_hook): two offload "
            "systems cannot be stacked; remove enable_model_cpu_offload first"
        )
    vars(module)[BRIDGE] = Bridge(on_enter, device)


def remove_bridge(module: torch.nn.Module) -> None:
    if isinstance(vars(module).get(BRIDGE), Bridge):
        del vars(module)[BRIDGE]


def wrap_entry(module: torch.nn.Module, name: str,
               wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Shadow the class's ``name`` method (``encode``, ``decode``) on this instance with
    ``wrap(bound method)``."""
    wrapped = functools.wraps(getattr(type(module), name))(wrap(getattr(type(module), name).__get__(module)))
    setattr(wrapped, _WRAPPED, True)
    vars(module)[name] = wrapped


def unwrap_entries(module: torch.nn.Module) -> None:
    for name in [n for n, v in vars(module).items() if getattr(v, _WRAPPED, False)]:
        del vars(module)[name]


def swap_class(obj: object, cls: type) -> None:
    """Give ``obj`` the subclass ``cls`` of its class (a modular block is called through its
    type's ``__call__``, which an instance attribute cannot shadow); `restore_class` undoes it."""
    if BLOCK_CLASS.get(obj) is None:
        BLOCK_CLASS.set(obj, type(obj))
    obj.__class__ = cls


def restore_class(obj: object) -> None:
    original = BLOCK_CLASS.pop(obj)
    if original is not None:
        obj.__class__ = original


def clear(obj: object) -> None:
    """Drop every key of ours that a release drops (the kept ones stay)."""
    for key in _KEYS:
        if not key.kept:
            key.pop(obj)


def leftovers(root: torch.nn.Module) -> list[str]:
    """What of ours is still on ``root`` or under it: attributes (except `KEPT_ON_PURPOSE`),
    hooks, the bridge, wrapped entry methods; ``path: what`` per finding."""
    found = []
    for path, module in root.named_modules():
        where = path or type(root).__name__
        found += [f"{where}: {attr}" for attr in vars(module)
                  if attr.startswith(PREFIX) and attr not in KEPT_ON_PURPOSE]
        found += [f"{where}: hook {name}" for name, hook in hooks_of(module).items()
                  if name in (*OUR_HOOKS, *DIFFUSERS_GROUP_HOOKS) and is_ours(name, hook)]
        if isinstance(vars(module).get(BRIDGE), Bridge):
            found.append(f"{where}: {BRIDGE} bridge")
        found += [f"{where}: wrapped {n}" for n, v in vars(module).items() if getattr(v, _WRAPPED, False)]
    return found

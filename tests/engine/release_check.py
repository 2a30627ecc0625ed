"""The release check of the group-offloading cases (issue 20): what a pipeline's components were
before placement (`snapshot`), and what of the engine is left on them after a release
(`leftovers`) or which weights changed (`changed_weights`). Imported by group_cases.py and the
tests that use it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from diffusers.hooks import group_offloading as diffusers_go
from diffusers_offload.offload_core.pinning import pinned_bytes
from diffusers_offload.offload_core.preload import PreloadPlanner
from fixtures.hook_inventory import hook_inventory

DIFFUSERS_GROUP_HOOKS = (diffusers_go._GROUP_OFFLOADING, diffusers_go._LAYER_EXECUTION_TRACKER,
                         diffusers_go._LAZY_PREFETCH_GROUP_OFFLOADING)
OURS = "_diffusers_offload_"  # the prefix of every attribute the engine puts on user objects


def named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


@dataclass
class Snapshot:
    """What a pipeline's components were before placement (or what the user made them since)."""

    pipe: object
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # comp.name -> (the object, a copy)
    attrs: dict[str, set[str]]  # comp.path -> keys of the module's __dict__
    hooks: dict[tuple[str, str, str], object]
    pipe_attrs: set[str]


def snapshot(pipe, components: tuple[str, ...]) -> Snapshot:
    weights, attrs = {}, {}
    for comp in components:
        module = getattr(pipe, comp)
        for name, t in named_tensors(module):
            weights[f"{comp}.{name}"] = (t, t.detach().clone())
        for path, sub in module.named_modules(remove_duplicate=False):
            attrs[f"{comp}.{path}"] = set(vars(sub))
    return Snapshot(pipe, weights, attrs, hook_inventory(pipe, components, torch_hooks=True), set(vars(pipe)))


def leftovers(pipe, before: Snapshot, components: tuple[str, ...], allowed: frozenset[str] = frozenset(),
              pipeline: bool = True) -> list[str]:
    """Everything of ours still on the pipeline after a release (empty when clean).

    Kept on purpose, documented in transport/preload.py and state.py: the preload planner
    (``_diffusers_offload_planner``, a `PreloadPlanner`) on a streamed denoiser's top module,
    so that a reload plans from the measures and penalties it learnt. ``allowed``: attributes
    the user's own actions since the snapshot add (their hooks' registry, a compiled call);
    ``pipeline``: look at the pipeline object's own attributes too."""
    found = [f"pipeline: {k}" for k in set(vars(pipe)) - before.pipe_attrs if pipeline and k.startswith(OURS)]
    for comp in components:
        for path, sub in getattr(pipe, comp).named_modules(remove_duplicate=False):
            new = set(vars(sub)) - before.attrs.get(f"{comp}.{path}", set()) - allowed
            found += [f"{comp}.{path}: {k}" for k in sorted(new)
                      if not (path == "" and isinstance(vars(sub)[k], PreloadPlanner))]
            registry = vars(sub).get("_diffusers_hook")
            found += [f"{comp}.{path}: hook {name}" for name in getattr(registry, "hooks", {})
                      if _ours(name) and (comp, path, name) not in before.hooks]
    after = hook_inventory(pipe, components, torch_hooks=True)
    found += [f"{k}: user hook gone or replaced" for k, v in before.hooks.items() if after.get(k) is not v]
    found += [f"{k}: torch hook" for k in after.keys() - before.hooks.keys() if k[2].startswith("torch:")]
    if pinned_bytes():
        found.append(f"{pinned_bytes()} bytes still pinned")
    return found


def changed_weights(before: Snapshot, expected: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Weights not bit-equal to ``expected`` (default: the snapshot's copies), or whose Parameter
    or buffer object was replaced."""
    now = {f"{comp}.{n}": t for comp in {k.split(".")[0] for k in before.weights}
           for n, t in named_tensors(getattr(before.pipe, comp))}
    out = []
    for name, (obj, copied) in before.weights.items():
        want = copied if expected is None else expected[name]
        same = obj.shape == want.shape if obj.is_meta else torch.equal(obj.detach(), want)  # meta: accelerate's
        if now.get(name) is not obj or obj.dtype != want.dtype or obj.device != want.device or not same:
            out.append(f"{name}: {obj.dtype} {obj.device} (expected {want.dtype} {want.device}, bit-equal, same object)")
    return out


def _ours(hook_name: str) -> bool:
    """Hook names the engine registers: its own, and diffusers' group-offloading names (its marker
    sits under ``group_offloading``; leaf groups are diffusers' own)."""
    return hook_name.startswith("diffusers_offload") or hook_name in DIFFUSERS_GROUP_HOOKS

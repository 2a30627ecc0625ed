"""Making a LoRA set effective on an engine-placed pipeline.

Why in place on the master copies: under offload a weight lives in several places (the pinned host
copy a streamed block is loaded from, a kept block's device buffer, diffusers' leaf-group CPU
copies, the live parameter). Writing every copy a transport loads from (``Transport.masters``)
means the next onload moves the patched weights, and no hook ever comes off: placement and LoRA
stay independent. This module knows transports only through that protocol.

- Fused (float weights): ``W = W0 + sum(strength * scale * up @ down)``, computed in float32 from a
  pageable host backup of ``W0``; the backup stays until the layer is no longer covered, so going
  back to the base (or to another set) writes ``W0`` back bit-exactly.
- Unfused (quantized components, fp8 or integer weights, where fusing would round the delta away):
  a forward hook on the layer adds the low-rank product; its factors live in host memory and are
  copied to wherever the layer's input is, so they move with their block.
- Each component remembers the signature (files' identities, strengths) of the set it carries;
  activating the same set again reads nothing and writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from ..components import iter_modules
from ..log import get_logger
from ..state import COMPONENT, LORA, LORA_REPORT, PIPELINE
from ..transport.base import Masters
from .files import LoraError, LoraFile, LoraLayer, identity, read_lora

log = get_logger("lora")

FUSABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

__all__ = ["LoraError", "LoraSpec", "activate", "check", "set_signature"]


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA of a set: a file and its strength (stacked LoRAs add up)."""

    path: str
    strength: float = 1.0


@dataclass
class _ComponentLora:
    """What one component carries: its set's signature, backups of the fused weights' original
    values (host, pageable), and the forward hooks of the unfused layers."""

    signature: tuple = ()
    backups: dict[str, torch.Tensor] = field(default_factory=dict)
    hooks: list[RemovableHandle] = field(default_factory=list)


@dataclass
class _Plan:
    """Per component: parameter name -> [(layer, strength)] to fuse; module path -> same, unfused."""

    fused: dict[str, list[tuple[LoraLayer, float]]] = field(default_factory=dict)
    unfused: dict[str, list[tuple[LoraLayer, float]]] = field(default_factory=dict)


def set_signature(specs: Sequence[LoraSpec]) -> tuple:
    """Identity of a set: each file's real path, size and mtime, with its strength, in order."""
    return tuple((identity(s.path), float(s.strength)) for s in specs)


def activate(pipe: object, specs: Sequence[LoraSpec]) -> None:
    """Make exactly ``specs`` effective on ``pipe`` (an empty set restores the base weights).

    Call between runs (after the engine's ``after_run``), placed or not. Every file is read and
    matched before the first weight is written, so a refused file changes nothing.
    """
    signature = set_signature(specs)
    components = dict(iter_modules(pipe))
    if all(_carried(m) == signature for m in components.values()):
        return
    files = [(read_lora(s.path, pipe), s.strength) for s in specs if s.strength != 0]
    plans = _plan(pipe, components, files)
    device = _compute_device(pipe)
    with torch.no_grad():
        for name, module in components.items():
            _apply(name, module, plans.get(name, _Plan()), signature, device)
    log.info("%s: LoRA set %s", type(pipe).__name__,
             ", ".join(f"{s.path} x{s.strength:g}" for s in specs) or "cleared (base weights)")


def check(pipe: object, spec: LoraSpec) -> None:
    """Read and match one LoRA without writing anything (raises `LoraError`, warns on a partial match)."""
    _plan(pipe, dict(iter_modules(pipe)), [(read_lora(spec.path, pipe), spec.strength)])


def _carried(module: torch.nn.Module) -> tuple:
    state: _ComponentLora | None = LORA.get(module)
    return state.signature if state is not None else ()


def _compute_device(pipe: object) -> torch.device:
    """Deltas are computed on the accelerator the pipeline runs on (a 14B LoRA is seconds there)."""
    pstate = PIPELINE.get(pipe)
    return pstate.device if pstate is not None and pstate.device.type == "cuda" else torch.device("cpu")


# -- matching ---------------------------------------------------------------------------------
def _plan(pipe: object, components: dict[str, torch.nn.Module],
          files: Iterable[tuple[LoraFile, float]]) -> dict[str, _Plan]:
    plans: dict[str, _Plan] = {}
    model = f"{type(pipe).__name__} ({getattr(pipe, 'name_or_path', '') or 'in memory'})"
    for lora, strength in files:
        total = sum(len(layers) for layers in lora.layers.values())
        matched = 0
        for comp, layers in lora.layers.items():
            module = components.get(comp)
            if module is None:
                continue
            quantized = _is_quantized(module)
            for path, layer in layers.items():
                target = _target(module, path)
                if target is None:
                    continue
                _check_shape(lora, comp, path, target, layer)
                plan = plans.setdefault(comp, _Plan())
                if quantized or target.weight.dtype not in FUSABLE:
                    if not isinstance(target, torch.nn.Linear):
                        log.warning("LoRA %s: %s.%s is a quantized %s: only linear layers take an unfused "
                                    "LoRA; layer skipped", lora.path, comp, path, type(target).__name__)
                        continue
                    plan.unfused.setdefault(path, []).append((layer, strength))
                else:
                    for suffix in _fused_params(target, layer):
                        plan.fused.setdefault(f"{path}.{suffix}", []).append((layer, strength))
                matched += 1
        if not matched:
            raise LoraError(f"LoRA {lora.path} matches no layer of {model}: it is for another model "
                            f"(its layers: {', '.join(sorted(lora.layers)) or 'none'}; "
                            f"e.g. {_first_key(lora)})")
        if matched < total or lora.skipped:
            log.warning("LoRA %s: %d of %d layers match %s; the other layers and %d stray tensors are ignored",
                        lora.path, matched, total, model, lora.skipped)
    return plans


def _is_quantized(module: torch.nn.Module) -> bool:
    qc = getattr(getattr(module, "config", None), "quantization_config", None)
    return (qc or getattr(module, "quantization_config", None)) is not None


def _target(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        target = module.get_submodule(path)
    except AttributeError:
        return None
    return target if isinstance(getattr(target, "weight", None), torch.Tensor) else None


def _fused_params(target: torch.nn.Module, layer: LoraLayer) -> list[str]:
    names = ["weight"] if layer.up is not None else []
    if layer.bias is not None and isinstance(getattr(target, "bias", None), torch.Tensor):
        names.append("bias")
    return names


def _check_shape(lora: LoraFile, comp: str, path: str, target: torch.nn.Module, layer: LoraLayer) -> None:
    weight = target.weight
    if layer.up is None:
        return
    want = (weight.shape[0], weight[0].numel())
    have = (layer.up.shape[0], layer.down[0].numel())
    if want != have:
        raise LoraError(f"LoRA {lora.path}: layer {comp}.{path} is {want[0]}x{want[1]} in the model but "
                        f"{have[0]}x{have[1]} in the LoRA: it is for another model size")


def _first_key(lora: LoraFile) -> str:
    for comp, layers in lora.layers.items():
        return f"{comp}.{next(iter(layers))}"
    return "no LoRA layers"


# -- writing ---------------------------------------------------------------------------------
def _apply(name: str, module: torch.nn.Module, plan: _Plan, signature: tuple, device: torch.device) -> None:
    if _carried(module) == signature:
        return
    # Stored before the first write: if a write fails, the backups taken so far are not lost and
    # the next activation (its signature still differs) recomputes every layer from them.
    state = LORA.get(module)
    if state is None:
        state = _ComponentLora()
        LORA.set(module, state)
    placed = COMPONENT.get(module)
    copies: Masters = placed.transport.masters() if placed is not None else {}
    if placed is not None:
        placed.transport.before_write()
    for pname in sorted(set(state.backups) | set(plan.fused)):
        param = module.get_parameter(pname)
        targets = _dedupe([*copies.get(id(param), []), param.data])
        if pname in plan.fused:
            base = state.backups.get(pname)
            if base is None:
                base = state.backups[pname] = _host_copy(targets[0])
            delta = _delta(plan.fused[pname], pname.endswith(".bias"), device).reshape(base.shape)
            # Moved first, converted on the device: ``.to(device, float32)`` converts on the host.
            value = (base.to(device).float() + delta).to(param.dtype)
        else:
            value = state.backups.pop(pname)
        for t in targets:
            t.copy_(value)
    for handle in state.hooks:
        handle.remove()
    state.hooks = [module.get_submodule(path).register_forward_hook(_LowRankDelta(entries))
                   for path, entries in plan.unfused.items()]
    state.signature = signature
    if not (signature or state.backups or state.hooks):
        LORA.pop(module)  # back to base: nothing of ours left on the module
    _record(name, module, plan)


def _dedupe(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[tuple[str, int]] = set()
    out = []
    for t in tensors:
        key = (str(t.device), t.data_ptr())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A pageable host copy (a clone of a pinned tensor could come from the pinned allocator)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)


def _delta(entries: list[tuple[LoraLayer, float]], bias: bool, device: torch.device) -> torch.Tensor:
    """The summed float32 delta of a weight (flattened to 2-D) or of a bias."""
    total = torch.zeros((), device=device)
    for layer, strength in entries:
        if bias:
            total = total + strength * layer.scale * layer.bias.to(device, torch.float32)
        else:
            up = layer.up.to(device, torch.float32).flatten(1)
            total = total + strength * layer.scale * (up @ layer.down.to(device, torch.float32).flatten(1))
    return total


class _LowRankDelta:
    """Forward hook: ``output + x @ down^T @ up^T (+ bias)``, the stacked LoRAs concatenated."""

    def __init__(self, entries: list[tuple[LoraLayer, float]]) -> None:
        weighted = [(layer, strength * layer.scale) for layer, strength in entries if layer.up is not None]
        self.down = torch.cat([layer.down.flatten(1) for layer, _ in weighted]) if weighted else None
        self.up = torch.cat([layer.up.flatten(1) * c for layer, c in weighted], dim=1) if weighted else None
        biases = [layer.bias * strength * layer.scale for layer, strength in entries if layer.bias is not None]
        self.bias = torch.stack(biases).sum(0) if biases else None

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        dtype = output.dtype
        if self.down is not None:
            down = self.down.to(x.device, dtype, non_blocking=True)
            up = self.up.to(x.device, dtype, non_blocking=True)
            output = output + F.linear(F.linear(x.to(dtype), down), up)
        if self.bias is not None:
            output = output + self.bias.to(x.device, dtype, non_blocking=True)
        return output


def _record(name: str, module: torch.nn.Module, plan: _Plan) -> None:
    """The path this component took, for the placement report (``details['lora']``)."""
    paths = [p for p, n in (("fused", plan.fused), ("unfused", plan.unfused)) if n]
    if not paths:
        LORA_REPORT.pop(module)
        return
    layers = len({p.rsplit(".", 1)[0] for p in plan.fused} | set(plan.unfused))
    LORA_REPORT.set(module, {"path": "+".join(paths), "layers": layers})
    log.info("%s: LoRA %s on %d layers", name, "+".join(paths), layers)

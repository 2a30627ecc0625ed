"""Making a LoRA set effective on an engine-placed pipeline.

Why in place on the master copies: under offload a weight lives in several places (the pinned host
copy a streamed block is loaded from, a kept block's device buffer, diffusers' leaf-group CPU
copies, the live parameter). Writing every copy a transport loads from (``Transport.masters``)
means the next onload moves the patched weights, and no hook ever comes off: placement and LoRA
stay independent. This module knows transports only through that protocol.

- Fused (plain bf16/fp16/fp32 weights): ``W = W0 + sum(strength * scale * up @ down)``, computed
  in float32 from ``W0``; going back to the base (or to another set) writes ``W0`` back
  bit-exactly. ``W0`` is read back from the safetensors file the component was loaded from where
  the file holds it unchanged (`restore.py`), else kept as a pageable host backup.
- Unfused (fp8 storage, GGUF parameters, other quantized layers, where fusing would round the
  delta away): a hook on the layer adds the low-rank product (`unfused.py`); removal takes it off.
- Each component remembers the signature (files' identities, strengths) of the set it carries;
  activating the same set again reads nothing and writes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..components import denoisers, iter_modules
from ..formats.stored_linear import StoredLinear
from ..log import get_logger
from ..state import COMPONENT, LORA, LORA_REPORT, PIPELINE
from ..transport.base import Masters
from . import unfused as hooks
from .files import LoraError, LoraFile, LoraLayer, identity, read_lora
from .restore import FileSource, WeightFiles, check_unchanged

log = get_logger("lora")
LINEAR = (torch.nn.Linear, StoredLinear)  # layers an unfused LoRA adds its product to

__all__ = ["INTO", "LoraError", "LoraSpec", "activate", "check", "set_signature"]

# Where a LoRA's denoiser layers go: the pipeline's first denoiser, its second (Wan 2.2 A14B's
# low-noise expert, ``transformer_2``: its LoRAs come in high/low-noise pairs), or both.
INTO = ("denoiser", "denoiser_2", "both")


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA of a set: a file, its strength (stacked LoRAs add up) and the denoiser(s) it goes into."""

    path: str
    strength: float = 1.0
    into: str = "denoiser"

    def __post_init__(self) -> None:
        if self.into not in INTO:
            raise ValueError(f"LoRA {self.path}: into={self.into!r} is not one of {INTO}")


@dataclass
class _ComponentLora:
    """What one component carries: its set's signature; where each fused weight's original value
    comes back from (its file, else a pageable host backup); the unfused layers' factors."""

    signature: tuple = ()
    backups: dict[str, torch.Tensor] = field(default_factory=dict)  # the RAM backup store
    sources: dict[str, FileSource] = field(default_factory=dict)  # restored from the file
    unfused: dict[str, hooks.Factors] = field(default_factory=dict)  # module path -> factors
    reasons: dict[str, str] = field(default_factory=dict)  # module path -> why unfused

    @property
    def changes_weights(self) -> bool:
        """The component computes differently from its base (a fused or an unfused layer)."""
        return bool(self.backups or self.sources or self.unfused)

    @property
    def hooks(self) -> list[str]:
        """What changes the outputs besides RAM backups (file-backed fused weights, unfused
        layers); kept for readers that test ``backups or hooks`` (use `changes_weights`)."""
        return [*self.sources, *self.unfused]


@dataclass
class _Plan:
    """Per component: parameter name -> [(layer, strength)] to fuse; module path -> same, unfused
    (with the reason, e.g. ``fp8``)."""

    fused: dict[str, list[tuple[LoraLayer, float]]] = field(default_factory=dict)
    unfused: dict[str, list[tuple[LoraLayer, float]]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)


def set_signature(specs: Sequence[LoraSpec]) -> tuple:
    """Identity of a set: each file's real path, size and mtime, with its strength and denoiser(s), in order."""
    return tuple((identity(s.path), float(s.strength), s.into) for s in specs)


def activate(pipe: object, specs: Sequence[LoraSpec]) -> None:
    """Make exactly ``specs`` effective on ``pipe`` (an empty set restores the base weights).

    Call between runs (after the engine's ``after_run``), placed or not, and after each
    placement: a teardown strips the unfused layers' hooks, and this call puts them back (from
    the factors kept on the component, no file read). Every LoRA file is read and matched, and
    every model file a base value comes back from is checked, before the first weight is
    written, so a refused file changes nothing.
    """
    signature = set_signature(specs)
    components = dict(iter_modules(pipe))
    for name, module in components.items():
        _reattach(name, module)
    if all(_carried(m) == signature for m in components.values()):
        return
    files = [(_read(pipe, s), s.strength) for s in specs if s.strength != 0]
    plans = _plan(pipe, components, files)
    for module in components.values():
        state: _ComponentLora | None = LORA.get(module)
        if state is not None and state.sources:
            check_unchanged(list(state.sources.values()))
    device = _compute_device(pipe)
    with torch.no_grad():
        for name, module in components.items():
            _apply(name, module, plans.get(name, _Plan()), signature, device)
    log.info("%s: LoRA set %s", type(pipe).__name__,
             ", ".join(f"{s.path} x{s.strength:g}{'' if s.into == 'denoiser' else ' into ' + s.into}"
                       for s in specs) or "cleared (base weights)")


def check(pipe: object, spec: LoraSpec) -> None:
    """Read and match one LoRA without writing anything (raises `LoraError`, warns on a partial match)."""
    _plan(pipe, dict(iter_modules(pipe)), [(_read(pipe, spec), spec.strength)])


def _read(pipe: object, spec: LoraSpec) -> LoraFile:
    """``spec``'s file read for ``pipe``, its first denoiser's layers moved where ``spec.into`` says."""
    lora = read_lora(spec.path, pipe)
    if spec.into == "denoiser":
        return lora
    names = list(denoisers(pipe))
    if len(names) < 2:
        raise LoraError(f"LoRA {spec.path}: {type(pipe).__name__} has one denoiser ({', '.join(names) or 'none'}), "
                        f"not two: set into to 'denoiser'")
    first, second = names[:2]
    layers = dict(lora.layers)
    moved = layers.pop(first, {}) if spec.into == "denoiser_2" else layers.get(first, {})
    layers[second] = {**layers.get(second, {}), **moved}
    return LoraFile(lora.path, layers, lora.skipped)


def _carried(module: torch.nn.Module) -> tuple:
    state: _ComponentLora | None = LORA.get(module)
    return state.signature if state is not None else ()


def _reattach(name: str, module: torch.nn.Module) -> None:
    """Unfused layers whose hooks a teardown (re-placement, release) stripped get them back."""
    state: _ComponentLora | None = LORA.get(module)
    if state is None or not state.unfused or hooks.attached(module, state.unfused):
        return
    hooks.detach(module, list(state.unfused))
    hooks.attach(module, state.unfused)
    log.info("%s: LoRA hooks re-attached on %d unfused layers (a placement change had taken them off)",
             name, len(state.unfused))


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
            for path, layer in layers.items():
                target = _target(module, path)
                if target is None:
                    continue
                _check_shape(lora, comp, path, target, layer)
                plan = plans.setdefault(comp, _Plan())
                reason = hooks.unfused_reason(module, target)
                if reason is not None:
                    if not isinstance(target, LINEAR):
                        log.warning("LoRA %s: %s.%s is a quantized %s: only linear layers take an unfused "
                                    "LoRA; layer skipped", lora.path, comp, path, type(target).__name__)
                        continue
                    plan.unfused.setdefault(path, []).append((layer, strength))
                    plan.reasons[path] = reason
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
    if isinstance(target, LINEAR):  # a GGUF or stored layer's weight's shape is its packed bytes'
        want = (target.out_features, target.in_features)
    else:
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
    # Stored before the first write: if a write fails, the sources and backups taken so far are
    # not lost and the next activation (its signature still differs) recomputes every layer from them.
    state = LORA.get(module)
    if state is None:
        state = _ComponentLora()
        LORA.set(module, state)
    files = WeightFiles.of(module)
    placed = COMPONENT.get(module)
    copies: Masters = placed.transport.masters() if placed is not None else {}
    if placed is not None:
        placed.transport.before_write()
    fresh: list[str] = []
    for pname in sorted(set(state.backups) | set(state.sources) | set(plan.fused)):
        param = module.get_parameter(pname)
        targets = _dedupe([*copies.get(id(param), []), param.data])
        base = _base(state, files, pname, targets[0], fresh)
        if pname in plan.fused:
            delta = _delta(plan.fused[pname], pname.endswith(".bias"), device).reshape(base.shape)
            # Moved first, converted on the device: ``.to(device, float32)`` converts on the host.
            value = (base.to(device).float() + delta).to(param.dtype)
        else:
            value = base
            state.backups.pop(pname, None)
            state.sources.pop(pname, None)
        for t in targets:
            t.copy_(value)
    hooks.detach(module, list(state.unfused))
    state.unfused = {path: hooks.Factors.of(entries) for path, entries in plan.unfused.items()}
    state.reasons = dict(plan.reasons)
    hooks.attach(module, state.unfused)
    state.signature = signature
    if fresh:
        _log_bases(name, files, state, fresh)
    if not (signature or state.backups or state.sources or state.unfused):
        LORA.pop(module)  # back to base: nothing of ours left on the module
    _record(name, module, plan, state)


def _base(state: _ComponentLora, files: WeightFiles, pname: str, master: torch.Tensor,
          fresh: list[str]) -> torch.Tensor:
    """``pname``'s original value: from its file or backup once fused; the live master the first
    time (then its restore source is chosen: the file if it holds this value, else a RAM copy)."""
    if pname in state.backups:
        return state.backups[pname]
    source = state.sources.get(pname)
    if source is not None:
        return files.read(source, master.dtype)
    fresh.append(pname)
    source = files.source(pname, master)
    if source is not None:
        state.sources[pname] = source
        return master
    state.backups[pname] = _host_copy(master)
    return state.backups[pname]


def _log_bases(name: str, files: WeightFiles, state: _ComponentLora, fresh: list[str]) -> None:
    in_ram = [p for p in fresh if p in state.backups]
    from_file = len(fresh) - len(in_ram)
    where = str(files.folder) if files.folder is not None else "no file (the model was not loaded from a folder)"
    if in_ram:
        log.info("%s: LoRA base values of %d weights restore from %s; %d kept in RAM (not in the files or "
                 "different from them, e.g. %s)", name, from_file, where, len(in_ram), in_ram[0])
    else:
        log.info("%s: LoRA base values of %d weights restore from %s, none kept in RAM", name, from_file, where)


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


def _record(name: str, module: torch.nn.Module, plan: _Plan, state: _ComponentLora) -> None:
    """The path this component took, for the placement report (``details['lora']``): fused and/or
    unfused, the layers covered and, for unfused ones, each layer's reason and the factors' bytes."""
    paths = [p for p, n in (("fused", plan.fused), ("unfused", plan.unfused)) if n]
    if not paths:
        LORA_REPORT.pop(module)
        return
    layers = len({p.rsplit(".", 1)[0] for p in plan.fused} | set(plan.unfused))
    report: dict[str, object] = {"path": "+".join(paths), "layers": layers}
    if plan.unfused:
        report["unfused"] = dict(state.reasons)
        report["factor_bytes"] = hooks.device_bytes(module, state.unfused)
    LORA_REPORT.set(module, report)
    kinds = Counter(state.reasons.values())
    log.info("%s: LoRA %s on %d layers%s", name, "+".join(paths), layers,
             f" (unfused: {', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))})" if kinds else "")

"""Component + config -> placement role, with the reason (logged and reported).

Roles decide *where* a component's weights live; transports (``transport/``) decide *how* they
move. The never list is tested before the always list, so a class entry in never exempts one
model from a component-name entry in always. Entries match names and classes case-insensitively;
an entry that matches nothing in the pipeline is warned about (`warn_unknown_entries`), not dropped
silently, since a typo there would otherwise leave a component placed as if the list were empty.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass

from .components import ComponentInfo
from .config import OffloadConfig
from .log import get_logger

log = get_logger("roles")


class Role(str, enum.Enum):
    RESIDENT = "resident"
    ON_DEMAND = "on-demand"
    PER_STEP = "per-step"
    LEAF = "leaf"


@dataclass(frozen=True)
class RoleDecision:
    role: Role
    reason: str
    lists: tuple[str, ...] = ()  # list entries that touched the component (part of its signature)
    # A leaf-role text encoder whose layers stream from pinned memory when the pin budget grants
    # it (partly pinned under a partial grant; SPEC §2, §12, §13); when it denies, it stays on leaf
    # groups from pageable memory.
    pinned_stream: bool = False


def with_stream_verdict(decision: RoleDecision, pinned: bool, streamed: bool,
                        grant: int | None = None) -> RoleDecision:
    """A ``pinned_stream`` decision's reason once the budget has spoken (for the report): the
    layers stream when the budget grants any of the encoder and its layers are most of it
    (`encoder_stream.streamable`), pinned up to a partial ``grant`` and the rest through staging
    buffers; a denial leaves the reason as it was (leaf groups)."""
    if not (decision.pinned_stream and pinned):
        return decision
    if not streamed:
        how = "pin granted, its layers under half of it: leaf groups"
    elif grant is None:
        how = "layers streamed from pinned memory"
    else:
        how = f"layers streamed, {grant / 2**30:.2f} GiB pinned, the rest through pinned staging buffers"
    return dataclasses.replace(decision, reason=f"{decision.reason}: {how}")


def pins_when_granted(info: ComponentInfo, decision: RoleDecision) -> bool:
    """Components other than denoisers that move from pinned memory when the budget grants it:
    on-demand modules (a VAE's whole-module move) and text encoders streamed by layer."""
    return decision.role is Role.ON_DEMAND or decision.pinned_stream


def _match(entries: tuple[str, ...], info: ComponentInfo) -> str | None:
    for entry in entries:
        if entry.casefold() in (info.name.casefold(), info.cls.casefold()):
            return entry
    return None


def unknown_entries(config: OffloadConfig, components: Iterable[tuple[str, object]]) -> tuple[str, ...]:
    """``"always 'x'"`` / ``"never 'y'"`` for each list entry naming none of ``(name, module)``."""
    known = {s.casefold() for name, module in components for s in (name, type(module).__name__)}
    return tuple(f"{lst} {e!r}" for lst in ("always", "never") for e in getattr(config, lst)
                 if e.casefold() not in known)


_WARNED: set[tuple] = set()


def warn_unknown_entries(config: OffloadConfig, components: Iterable[tuple[str, object]],
                         pipeline: str = "the pipeline") -> str | None:
    """Warn (once per entries and pipeline layout) about list entries that match no component;
    the message, or None when every entry matches. The placement pass calls it with the whole
    pipeline's ``(name, module)`` pairs."""
    components = list(components)
    unknown = unknown_entries(config, components)
    if not unknown:
        return None
    layout = ", ".join(f"{name} ({type(module).__name__})" for name, module in components)
    message = (f"offload list entries {', '.join(unknown)} match no component of {pipeline} and are ignored; "
               f"its components are {layout or 'none'} (names and classes match case-insensitively)")
    key = (unknown, pipeline, layout)
    if key not in _WARNED:
        if len(_WARNED) > 256:
            _WARNED.clear()
        _WARNED.add(key)
        log.warning("%s", message)
    return message


def decide(info: ComponentInfo, config: OffloadConfig) -> RoleDecision:
    never = _match(config.never, info)
    if never is not None:
        return RoleDecision(Role.RESIDENT, f"never list ({never!r})", (f"never:{never}",))
    always = _match(config.always, info)
    lists = (f"always:{always}",) if always is not None else ()
    decision = _decide_by_mode(info, config, forced=always is not None)
    if always is not None:
        decision = RoleDecision(decision.role, f"{decision.reason}; always list ({always!r})", lists)
    return decision


def _decide_by_mode(info: ComponentInfo, config: OffloadConfig, forced: bool) -> RoleDecision:
    if config.mode == "none" and not forced:
        return RoleDecision(Role.RESIDENT, "mode none")
    if info.unbridged_entries and not info.bridged_entries and config.mode in ("auto", "model"):
        log.warning(
            "%s (%s) has %s without diffusers' forward-hook bridge: kept resident (cannot onload on entry)",
            info.name, info.cls, "/".join(info.unbridged_entries),
        )
        return RoleDecision(Role.RESIDENT, f"{'/'.join(info.unbridged_entries)} without bridge")
    if info.opts_out or info.bridged_entries or config.mode == "model":
        if not forced and info.nbytes < config.on_demand_threshold_bytes:
            return _SMALL
        return RoleDecision(Role.ON_DEMAND, _on_demand_reason(info, config))
    if not forced and info.nbytes < config.resident_floor_bytes:
        return _SMALL
    if config.mode == "leaf":
        return RoleDecision(Role.LEAF, "mode leaf")
    if info.is_denoiser:
        return RoleDecision(Role.PER_STEP, "denoiser: block stream per step")
    reason = _once_per_run(info)
    if info.is_text_encoder and config.mode == "auto" and info.nbytes >= config.on_demand_threshold_bytes:
        return RoleDecision(Role.LEAF, reason, pinned_stream=True)
    return RoleDecision(Role.LEAF, reason)


def _once_per_run(info: ComponentInfo) -> str:
    """What a leaf-placed component is, for the report: an image encoder (CLIP vision) is not a
    text encoder although transformers makes both."""
    if not info.is_text_encoder:
        return "once-per-run module"
    return "image encoder" if "Vision" in info.cls or "Image" in info.cls else "text encoder"


_SMALL = RoleDecision(Role.RESIDENT, "small: moving it would cost more than it frees")


def _on_demand_reason(info: ComponentInfo, config: OffloadConfig) -> str:
    if info.opts_out:
        return "class opts out of group offload"
    if info.bridged_entries:
        return f"entered through the {'/'.join(info.bridged_entries)} bridge"
    return "mode model: whole module on demand"

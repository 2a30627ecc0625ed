"""How a component's weights reach the device, decided once per placement and logged once.

- **pinned**: the pin budget grants the component's bytes; its streamed weights are page-locked
  in place and copied on the side stream;
- **partly pinned**: the budget grants part (`memory.pin_budget`); the block streamer (a denoiser's,
  or a text encoder's layers) pins blocks until the grant is used and copies the rest through a
  small ring of pinned staging buffers (`transport/staging.py`), on the same side stream;
- **staged**: nothing pinned (``pin_memory`` off, ComfyUI's ``--disable-pinned-memory``, a denied
  budget): the block streamer still keeps its side stream, through the staging buffers;
- **synchronous**: no side stream (``use_stream`` off, a device without streams), or a
  component under diffusers' leaf groups without a full grant (their streams pin a copy of
  every weight themselves, so they run only where the whole component is granted).
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from .components import ComponentInfo
from .config import OffloadConfig
from .formats.mapped import mapped_bytes
from .log import get_logger
from .memory import MemoryReader, PinVerdict, pin_budget
from .pinning import pinned_bytes
from .report import gib
from .roles import Role, RoleDecision, pins_when_granted
from .state import PIN_VERDICT
from .transport import TransportContext

log = get_logger("engine")


def wants_pin(info: ComponentInfo, decision: RoleDecision) -> bool:
    """Components whose weights are copied every step (the streamed denoisers), and those that move
    from pinned memory when the budget grants it (`roles.pins_when_granted`)."""
    return (decision.role is Role.PER_STEP or (decision.role is Role.LEAF and info.is_denoiser)
            or pins_when_granted(info, decision))


def pin_verdict(module: torch.nn.Module, info: ComponentInfo, decision: RoleDecision, config: OffloadConfig,
                memory: MemoryReader, own: int = 0) -> PinVerdict | None:
    """The component's pin verdict, cached on it: a granted pin lowers the very reading it was
    granted against. ``own``: bytes the component holds pinned now (a re-placement), which do not
    count against the caps as another component's would. None when pinning is not asked for."""
    verdict = _verdict(module, info, decision, config, memory, own)
    note_disk_reads(module, info, decision, verdict, memory)
    return verdict


def _verdict(module: torch.nn.Module, info: ComponentInfo, decision: RoleDecision, config: OffloadConfig,
             memory: MemoryReader, own: int) -> PinVerdict | None:
    if not (wants_pin(info, decision) and config.pin_memory and config.use_stream):
        return None
    cached: PinVerdict | None = PIN_VERDICT.get(module)
    key = (info.nbytes, config.pin_reserve_bytes, config.host_ram_bytes)
    if cached is not None and cached.key == key:
        return cached
    verdict = replace(pin_budget(info.nbytes, memory, config.pin_reserve_bytes, budget=config.host_ram_bytes,
                                 held=max(pinned_bytes() - own, 0)), key=key)
    PIN_VERDICT.set(module, verdict)
    return verdict


_disk_noted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> the (bytes, grant) logged


def note_disk_reads(module: torch.nn.Module, info: ComponentInfo, decision: RoleDecision,
                    verdict: PinVerdict | None, memory: MemoryReader) -> None:
    """A streamed component whose unpinned weights are memory-mapped (`formats/mapped.py`) reads
    them from the page cache each step; when free RAM cannot cache them all, from the disk: said
    once per placement, with the bytes per step (up to all of them: a cyclic read larger than
    the cache misses it throughout)."""
    if not (decision.role is Role.PER_STEP or (decision.role is Role.LEAF and info.is_denoiser)):
        return
    grant = verdict.grant if verdict is not None else 0
    key = (info.nbytes, grant)
    if _disk_noted.get(module) == key:
        return
    _disk_noted[module] = key
    streamed = min(mapped_bytes(module), max(info.nbytes - grant, 0))
    if not streamed:
        return
    room = max(memory.host_available() - grant, 0)  # the pins take their grant from free memory
    if room >= streamed:
        log.info("%s: %s streamed from its memory-mapped files each step, cached in RAM (%s free)", info.name,
                 gib(streamed), gib(room))
        return
    log.warning("%s: %s streamed from its memory-mapped files each step and free RAM (%s) cannot cache them: "
                "expect %s to %s read from disk per step, at the disk's pace", info.name, gib(streamed),
                gib(room), gib(streamed - room), gib(streamed))


def transport_context(info: ComponentInfo, decision: RoleDecision, config: OffloadConfig, device: torch.device,
                      verdict: PinVerdict | None, memory: MemoryReader, owner: object,
                      layered: bool = False) -> TransportContext:
    """The transport's settings from the verdict (see the module docstring), and the one log line
    that says which path the component's copies take. ``layered``: a text encoder whose layers the
    block streamer can take (`encoder_stream.streamable`): with any grant it streams like a
    denoiser, partly pinned when the grant is part of it."""
    full = verdict is not None and verdict.granted
    grant = verdict.grant if verdict is not None else 0
    streamer = decision.role is Role.PER_STEP or (layered and grant > 0)
    streams = device.type == "cuda" and config.use_stream and (streamer or full)
    pin = grant > 0 if streamer else full
    ctx = TransportContext(onload_device=device, config=config, streams=streams, pin=pin,
                           pin_bytes=None if full or not pin else grant, memory=memory, owner=owner)
    if wants_pin(info, decision):
        _log_path(info, config, verdict, ctx, streamer)
    return ctx


def _log_path(info: ComponentInfo, config: OffloadConfig, verdict: PinVerdict | None, ctx: TransportContext,
              streamer: bool) -> None:
    why = verdict.describe() if verdict is not None else (
        "pin_memory off" if not config.pin_memory else "use_stream off")
    volume = gib(info.nbytes)
    if verdict is not None and verdict.granted:
        log.info("%s: %s -> pinned in place%s", info.name, why, ", side-stream prefetch" if ctx.streams else "")
    elif ctx.streams and ctx.pin:
        log.info("%s: %s -> blocks pinned up to the grant, the rest (up to %s) copied every step from pageable "
                 "memory through pinned staging buffers on the side stream", info.name, why,
                 gib(info.nbytes - (ctx.pin_bytes or 0)))
    elif ctx.streams:
        log.warning("%s: %s -> %s copied from pageable memory every step through pinned staging buffers on the "
                    "side stream", info.name, why, volume)
    else:
        log.warning("%s: %s -> %s without streams (on %s): %s moved from pageable memory every step", info.name,
                    why, "block level" if streamer else "leaf level", ctx.onload_device, volume)

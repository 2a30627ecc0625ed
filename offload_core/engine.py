"""The one placement pass, release, and the force sweep.

``place`` orchestrates only: per component it reads facts (components.py), decides a role
(roles.py), compares the config signature, and hands the module to a transport (transport/),
which it then talks to through the `Transport` protocol alone. State lives on the user's objects,
under the keys of state.py; the engine keeps pipelines only through weak references.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .components import ComponentInfo, describe, iter_modules
from .config import OffloadConfig
from .formats.mapped import loader_ranges, mapped_bytes
from .guards import onload_device, refuse_foreign_offload, refuse_unmovable_quantization
from .log import get_logger
from .memory import MemoryReader, PinVerdict, sweep_cleanup
from .pin_path import pin_verdict, transport_context
from .preload.shared import SharedBudget
from .report import ComponentReport, PlacementReport, gib
from .roles import Role, RoleDecision, decide, warn_unknown_entries, with_stream_verdict
from .run import prompt_cache
from .state import (
    APPLYING,
    COMPONENT,
    DIFFUSERS_GROUP_HOOKS,
    LORA_REPORT,
    MARKER,
    OUR_HOOKS,
    PIN_VERDICT,
    PIPELINE,
    PROMPT_CACHE,
)
from .state import clear as clear_state
from .transport import LeafGroupTransport, OnDemandTransport, ResidentTransport, Transport, TransportContext
from .transport.base import strip_hooks
from .transport.dequant import refuse_layerwise_casting, register_dequant, remove_dequant
from .transport.encoder_stream import EncoderStreamer, streamable
from .transport.on_demand import OnDemandGroup
from .transport.preload import PreloadingStreamer
from .transport.streamer import BlockStreamer

log = get_logger("engine")


@dataclass
class ComponentState:
    signature: tuple
    transport: Transport
    decision: RoleDecision
    info: ComponentInfo


@dataclass
class PipelineState:
    config: OffloadConfig
    device: torch.device
    on_demand: OnDemandGroup = field(default_factory=OnDemandGroup)
    logged: tuple = ()


@dataclass(frozen=True)
class SweepResult:
    moved: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]


class Engine:
    """Places pipelines and takes them back; ``memory`` is injectable for scripted readings."""

    def __init__(self, memory: MemoryReader | None = None) -> None:
        self.memory = memory or MemoryReader()
        self._pipelines: weakref.WeakSet = weakref.WeakSet()

    # -- placement ------------------------------------------------------------------------
    def place(self, pipe: object, config: OffloadConfig) -> PlacementReport:
        device = onload_device(config)
        components = list(iter_modules(pipe))
        refuse_foreign_offload(components)
        refuse_unmovable_quantization(components, config)
        refuse_layerwise_casting(components)
        warn_unknown_entries(config, components, type(pipe).__name__)
        pstate = PIPELINE.get(pipe)
        if pstate is None or pstate.device != device:
            pstate = PipelineState(config, device)
            PIPELINE.set(pipe, pstate)
        pstate.config = config
        pstate.on_demand.make_room = _room_maker(self, pipe)
        self._pipelines.add(pipe)
        try:
            for name, module in components:
                self._place_component(name, module, config, pstate)
        except BaseException:
            if not self.states(pipe):  # nothing placed: the pipeline is as it was
                PIPELINE.pop(pipe)
                self._pipelines.discard(pipe)
            raise
        self._link_parking(pipe, pstate)
        prompt_cache.install(pipe, config.prompt_cache_bytes, device)
        report = self.report(pipe)
        key = tuple((c.name, c.role, c.reason) for c in report.components)
        if key != pstate.logged:
            log.info("placement of %s\n%s", report.pipeline, report.text())
            pstate.logged = key
        return report

    def _place_component(self, name: str, module: torch.nn.Module, config: OffloadConfig,
                         pstate: PipelineState) -> None:
        if APPLYING.get(module):
            log.warning("%s was left mid-apply by an earlier pass: tearing it down and applying again", name)
            self._teardown(module)
        info = describe(name, module)
        decision = decide(info, config)
        verdict = self._pin_verdict(module, info, decision, config)
        signature = _signature(decision, config, pstate.device, verdict)
        state: ComponentState | None = COMPONENT.get(module)
        if state is not None and state.signature == signature:
            state.transport.retune(config)  # e.g. the kept blocks change without re-hooking
            return
        if state is not None:
            log.info("%s: settings changed, re-placing (%s -> %s)", name, state.decision.role.value, decision.role.value)
            self._teardown(module)
        APPLYING.set(module, True)
        try:
            layered = decision.pinned_stream and streamable(module)
            ctx = self._context(config, pstate, verdict, info, decision, layered)
            streamed = layered and ctx.pin
            decision = with_stream_verdict(decision, ctx.pin, streamed, ctx.pin_bytes)
            transport = EncoderStreamer(ctx) if streamed else _make_transport(decision.role, ctx, info)
            COMPONENT.set(module, ComponentState(signature, transport, decision, info))
            fp8 = register_dequant(module)  # before the transport's hooks: the onload runs first
            transport.apply(module)
            cast = transport.self_cast()
            remove_dequant([layer for layer in fp8 if id(layer.weight) in cast])
        except BaseException:
            self._teardown(module)
            PIN_VERDICT.pop(module)
            raise
        APPLYING.pop(module)
        log.info("%s (%s, %s): %s — %s", name, info.cls, gib(info.nbytes), decision.role.value, decision.reason)

    def _pin_verdict(self, module: torch.nn.Module, info: ComponentInfo, decision: RoleDecision,
                     config: OffloadConfig) -> PinVerdict | None:
        """Cached on the component (`pin_path.pin_verdict`); its own pins do not count against it."""
        state: ComponentState | None = COMPONENT.get(module)
        own = state.transport.pinned_bytes() if state is not None else 0
        return pin_verdict(module, info, decision, config, self.memory, own)

    def _context(self, config: OffloadConfig, pstate: PipelineState, verdict: PinVerdict | None,
                 info: ComponentInfo, decision: RoleDecision, layered: bool = False) -> TransportContext:
        return transport_context(info, decision, config, pstate.device, verdict, self.memory, pstate.on_demand,
                                 layered)

    def _link_parking(self, pipe: object, pstate: PipelineState) -> None:
        """A streamed denoiser's forward sends idle components home first (a VAE between its
        encodes and decode, an encoder's non-layer part), before its plan reads the free memory.
        On-demand modules stay between their own calls only where that happens for every denoiser
        (streamed, or on demand: entering evicts idle peers). Several planned denoisers (Wan 2.2
        A14B) share one budget: a starting one's plan or shortage takes the idle ones' kept
        blocks first (`preload/shared.py`)."""
        denoisers = [s.transport for s in self.states(pipe).values() if s.info.is_denoiser]
        park = _parker(self, pipe)
        for transport in denoisers:
            if isinstance(transport, BlockStreamer):
                transport.events.unsubscribe(PARK)
                transport.events.subscribe(PARK, park, first=True)
        planned = [(n, s.transport) for n, s in self.states(pipe).items()
                   if s.info.is_denoiser and isinstance(s.transport, PreloadingStreamer)]
        budget = SharedBudget(planned) if len(planned) > 1 else None  # one VRAM budget over them
        for _name, transport in planned:
            transport.share(budget)
        pstate.on_demand.stay = all(isinstance(t, (BlockStreamer, OnDemandTransport, ResidentTransport))
                                    for t in denoisers)

    # -- release --------------------------------------------------------------------------
    def _teardown(self, module: torch.nn.Module) -> None:
        """Strip every hook before weights move back (hooks would keep pinned copies alive)."""
        state: ComponentState | None = COMPONENT.pop(module)
        if state is not None:
            state.transport.remove(module)
        strip_hooks(module, (*OUR_HOOKS, *DIFFUSERS_GROUP_HOOKS, MARKER))
        APPLYING.pop(module)

    def release(self, pipe: object, collect: bool = True) -> None:
        """Take everything back: hooks off, weights in system memory, pinned pages released.
        ``collect`` off: no garbage collection here (a host iterating its own list of models, whose
        finalizers a collection would run, collects later itself)."""
        for name, module in iter_modules(pipe):
            try:
                self._teardown(module)
            except Exception as exc:  # keep releasing the others; report what failed
                log.error("release of %s failed: %s: %s", name, type(exc).__name__, exc)
            clear_state(module)
        prompt_cache.remove(pipe)
        clear_state(pipe)
        self._pipelines.discard(pipe)
        sweep_cleanup(collect)
        log.info("released %s", type(pipe).__name__)

    def sweep(self, pipes: list[object] | None = None) -> SweepResult:
        """Force sweep: every component resting on the device while idle goes back to system
        memory, across every pipeline variant we placed; a failing component is reported, not fatal."""
        moved: list[str] = []
        failed: list[tuple[str, str]] = []
        for pipe in [*(pipes or []), *list(self._pipelines)]:
            for name, state in self.states(pipe).items():
                try:
                    if state.transport.offload_idle():
                        moved.append(name)
                except Exception as exc:
                    failed.append((name, f"{type(exc).__name__}: {exc}"))
                    log.error("sweep could not move %s: %s", name, exc)
        sweep_cleanup()
        return SweepResult(tuple(moved), tuple(failed))

    # -- run-time services for hosts ------------------------------------------------------------
    def after_run(self, pipe: object) -> None:
        """End of a pipeline call: on-demand modules go home, streamed blocks are released (their
        streaming buffers stay for the next call: `BlockStreamer.after_run`)."""
        for state in self.states(pipe).values():
            state.transport.after_run()
        pstate = PIPELINE.get(pipe)
        if pstate is not None:
            pstate.on_demand.offload_all()

    def give_back(self, pipe: object, nbytes: int) -> int:
        """Free device memory without unhooking (kept blocks, idle on-demand modules)."""
        freed = 0
        for state in self.states(pipe).values():
            if freed < nbytes:
                freed += state.transport.give_back(nbytes - freed)
        return freed

    def memory_required(self, pipe: object) -> int:
        """What the next run needs on the device beyond what we hold: the largest single need,
        since stages run one after another (a VAE moves in after the denoiser is done). Hosts
        ask their memory manager for this much before a run, as they do for their own models."""
        return max((s.transport.run_bytes() for s in self.states(pipe).values()), default=0)

    def device_bytes(self, pipe: object) -> int:
        """Device bytes ``pipe``'s components hold now: the report's total, without its walk over
        every tensor (hosts ask for it often: ComfyUI's ``loaded_size``)."""
        return sum(s.transport.device_bytes() for s in self.states(pipe).values())

    def states(self, pipe: object) -> dict[str, ComponentState]:
        return {n: state for n, m in iter_modules(pipe) if (state := COMPONENT.get(m)) is not None}

    def report(self, pipe: object) -> PlacementReport:
        pstate, comps, ranges = PIPELINE.get(pipe), [], loader_ranges()
        for name, module in iter_modules(pipe):
            state = COMPONENT.get(module)
            info = state.info if state is not None else describe(name, module)
            comps.append(_component_report(info, state, LORA_REPORT.get(module), mapped_bytes(module, ranges)))
        return PlacementReport(
            pipeline=type(pipe).__name__,
            device=str(pstate.device) if pstate else "unplaced",
            mode=pstate.config.mode if pstate else "-",
            components=tuple(comps),
            plan=_plans(comps),
            prompt_cache=cache.summary() if (cache := PROMPT_CACHE.get(pipe)) is not None else "",
        )


def _room_maker(engine: Engine, pipe: object) -> Callable[[int], int]:
    """``give_back`` on ``pipe`` for its on-demand modules, held weakly: the pipeline's state must
    not keep the pipeline (or the engine) alive."""
    engine_ref, pipe_ref = weakref.ref(engine), weakref.ref(pipe)

    def make_room(nbytes: int) -> int:
        owner, target = engine_ref(), pipe_ref()
        return owner.give_back(target, nbytes) if owner is not None and target is not None else 0

    return make_room


PARK = "park_idle"


def _parker(engine: Engine, pipe: object) -> Callable[..., bool]:
    """The denoiser-start listener of `Engine._link_parking`, holding engine and pipeline weakly."""
    engine_ref, pipe_ref = weakref.ref(engine), weakref.ref(pipe)

    def park(event: str, source: object, **_info: object) -> bool:
        owner, target = engine_ref(), pipe_ref()
        if event == "forward" and owner is not None and target is not None:
            for state in owner.states(target).values():
                if state.transport is not source and state.transport.offload_idle():
                    log.debug("%s went home: a denoiser starts", state.info.name)
        return False

    return park


def _plans(comps: list[ComponentReport]) -> str:
    """The preload plan line, each denoiser's named when there are several (Wan 2.2 A14B)."""
    plans = [(c.name, str(c.details["plan"])) for c in comps if c.details.get("plan")]
    return plans[0][1] if len(plans) == 1 else "; ".join(f"{name}: {plan}" for name, plan in plans)


def _component_report(info: ComponentInfo, state: ComponentState | None,
                      lora: dict[str, object] | None = None, mapped: int = 0) -> ComponentReport:
    t = state.transport if state is not None else None
    details = {**(t.details() if t else {}), **({"lora": lora} if lora else {}),
               **({"mapped_bytes": mapped} if mapped else {})}
    return ComponentReport(
        name=info.name,
        cls=info.cls,
        role=state.decision.role.value if state else "unplaced",
        reason=state.decision.reason if state else "",
        nbytes=info.nbytes,
        dtypes=info.dtypes,
        quantization=info.quantization,
        device_bytes=t.device_bytes() if t else 0,
        pinned_bytes=t.pinned_bytes() if t else 0,
        details=details,
    )


def _signature(decision: RoleDecision, config: OffloadConfig, device: torch.device,
               verdict: PinVerdict | None) -> tuple:
    """What a component was hooked with: a change re-places it; anything else is a retune."""
    return decision.role, decision.lists, verdict.grant if verdict else None, str(device), config.hooking()


def _make_transport(role: Role, ctx: TransportContext, info: ComponentInfo) -> Transport:
    if role is Role.RESIDENT:
        return ResidentTransport(ctx, info.bridged_entries)
    if role is Role.ON_DEMAND:
        return OnDemandTransport(ctx, info.bridged_entries)
    if role is Role.PER_STEP:
        return PreloadingStreamer(ctx)
    return LeafGroupTransport(ctx)


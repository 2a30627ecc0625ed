"""CUDA graphs for the block streamer's calls: a call (a kept block, a streamed unit) is launched as one
captured graph instead of its few dozen kernels, once it has run twice with inputs of one shape and its
weights in one place.

Why: an image-sized step of a large denoiser is bound by the host launching kernels, not by the GPU
(bench/README.md, runs 25-29), and the host's speed varies from process to process. A graph bakes in every
address its kernels read, so its key names where its weights lie (`block_graphs.py` says which calls and
keys); its inputs are copied into static buffers shared by the calls of one input signature, its outputs
come back as fresh tensors, and every graph is dropped when a weight is written (a LoRA), at a shortage
and at release (with the driver's memory for them under cudaMallocAsync, `graph_memory.py`, where those
whose weights a plan change moved go too). A graph is trusted only after its first replay reproduced the
eager output bit for bit; a block whose replay differs stays eager for that signature, and one whose
capture fails (a kernel that syncs or allocates on the host) stays eager everywhere until a weight write.
Trust is the call's, not its place's: a call trusted once is captured at its first call in a new place
(kept blocks taken back after the other denoiser ran, a ring made again after a decode took its room),
without the check replay, until a weight write; and at its first call with a new input signature (a new
prompt's token count), with the check replay. Large inputs (a video's activations) stay eager: there the
math, not the launch, bounds the step, and static buffers would cost memory. Why not ``torch.cuda.graph``:
it collects garbage and empties the allocator's cache at each capture (here the cache is emptied only for
a capture that ran out of memory).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..log import get_logger
from . import graph_memory
from .call_keys import Key, describe, describe_value, rebuild

log = get_logger("graphs")

SIGNATURES = 8  # input signatures graphed at once; one more (a new size each run) drops them all
GUESSES = 2  # new signatures a trusted call is captured at first sight with, unreplayed at once (with and without guidance)
CALLS_KEPT = 4096  # (block, signature) counts kept; inputs that change every call (a float) would grow them


@dataclass(eq=False)
class StaticIO:
    """The buffers the graphs of one input signature read their inputs from and write their
    outputs to: one set shared by every block of that signature (they run one after another)."""

    inputs: list[torch.Tensor]
    outputs: dict[Key, list[torch.Tensor]] = field(default_factory=dict)  # by the output's key

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.inputs) + sum(t.nbytes for ts in self.outputs.values() for t in ts)

    def load(self, tensors: list[torch.Tensor]) -> None:
        for static, t in zip(self.inputs, tensors, strict=True):
            static.copy_(t)


@dataclass(eq=False)
class CallGraph:
    """One call's captured forward for one input signature."""

    graph: torch.cuda.CUDAGraph
    io: StaticIO
    out_key: Key
    units: list[int]  # the unit indices the eager forward ran, in order (the streamer's order learning)
    device: torch.device
    inputs: list[torch.Tensor] = field(default_factory=list)  # this call's tensors, set by `GraphCache.plan`
    guessed: bool = False  # captured at its signature's first call and not replayed yet (`GraphCache._guess`)
    first_launch: Callable[[int, float], None] | None = None  # told the driver memory its first launch took, and its host s
    need: int = 0  # the driver graph memory its first launch maps (`graph_memory.footprint`; 0: none or unknown)

    def replay(self) -> object:
        """Run the graph on this call's inputs; the outputs as fresh tensors (a caller may keep
        them past the next call's replay, which rewrites the static outputs)."""
        self.io.load(self.inputs)
        self.inputs = []
        first = self.first_launch
        before, began = (graph_memory.reserved(self.device), time.perf_counter()) if first else (0, 0.0)
        graph_memory.launch(self.graph)
        if first:
            self.first_launch = None
            first(graph_memory.reserved(self.device) - before, time.perf_counter() - began)
        return rebuild(self.out_key, [t.clone() for t in self.io.outputs[self.out_key]])


class GraphCache:
    """The graphs of one streamer's calls, by owner key and input signature, in one memory pool
    (graphs replayed one after another may share their intermediates' memory)."""

    CAPTURE = "capture"  # `plan`: run eagerly now, then capture

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.enabled = False
        self._entries: dict[tuple[Key, Key], CallGraph | int | None] = {}  # eager calls so far; None: refused
        self._trusted: set[tuple[Key, Key]] = set()  # (what is called, signature) whose replay was checked
        self._guesses: dict[Key, set[Key]] = {}  # what is called: the signatures it was captured at first sight with, unreplayed
        self._failing: set[Key] = set()  # what is called whose capture raised: eager in every place, for every signature
        self._unchecked: dict[tuple[Key, Key], CallGraph] = {}  # captured, the check replay waiting for room (`_room_for`)
        self._io: dict[Key, StaticIO] = {}
        self._pool: tuple | None = None
        self._stream: torch.cuda.Stream | None = None
        self.pool_bytes = 0  # reserved for the graphs' intermediates: cached, but not ours to reuse
        self.driver_bytes = 0  # the driver's graph memory the graphs' first launches took (`graph_memory`)
        self.need = 0  # the most driver graph memory one of its graphs' first launch maps (`_room_for`)
        self.waiting = 0  # the most a graph whose first launch waits for room needs, since the last `clear`
        self._stuck = 0  # the allocator's cached memory its last emptying for a launch could not give back
        self.captured = self.refused = 0
        self.signatures = SIGNATURES  # input signatures kept at once (`_static_io`)
        self.retried = 0  # captures made again after running out of memory (`_record`)
        self.replayed = self.described = 0  # over its life: graphs replayed; calls that could be graphed (`plan`)
        self.first_launches, self.first_launch_s = 0, 0.0  # launches that instantiated or mapped, their host s (DEBUG)
        self.starved = False  # a capture ran out of memory: none until the next `clear`
        self.held = False  # no capture now, nor a call counted towards one (`graph_worth.py` times an eager forward)
        graph_memory.track(self)
        self._said: set[str] = set()  # refusal reasons logged once
        self.enable(enabled)

    def enable(self, on: bool) -> None:
        """Graphs on (where the device is CUDA) or off (every graph dropped)."""
        self.enabled = on and self.device.type == "cuda"
        if not self.enabled:
            self.forget()

    @property
    def on(self) -> bool:
        """Whether calls may still be captured: enabled, and no launch ran out of memory."""
        return self.enabled and not graph_memory.launch_failed()

    def __len__(self) -> int:
        return sum(isinstance(e, CallGraph) for e in self._entries.values())

    def owners(self) -> set[Key]:
        """The owner keys (`plan`) that have a trusted graph."""
        return {owner for (owner, _key), e in self._entries.items() if isinstance(e, CallGraph)}

    @property
    def nbytes(self) -> int:
        """Device bytes the graphs hold: their pool (the allocator's or the driver's) and the static buffers."""
        return self.pool_bytes + self.driver_bytes + sum(io.nbytes for io in self._io.values())

    def _took(self, nbytes: int, seconds: float) -> None:
        self.first_launches, self.first_launch_s = self.first_launches + 1, self.first_launch_s + seconds
        if nbytes > 0:
            self.driver_bytes += nbytes
            log.debug("a graph's first launch took %.0f MiB of the driver's graph memory (this cache's: %.0f MiB)",
                      nbytes / (1 << 20), self.driver_bytes / (1 << 20))

    def wants(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call with these inputs may be graphed now."""
        return self.on and not self.starved and describe(args, kwargs) is not None

    def plan(self, owner: tuple[Key, Key], args: tuple, kwargs: dict) -> CallGraph | str | None:
        """For a call of ``owner`` (what is called, and where its weights lie): its trusted graph
        (with this call's inputs), `CAPTURE` (its second eager call with this signature, its first
        in this place when the call is trusted, or its first with this signature when trusted with
        another (`_guess`): capture after it), or None (run eagerly)."""
        if self.starved or not self.on or owner[0] in self._failing:
            return None
        call = describe(args, kwargs)
        if call is None:
            return None
        key, tensors = call
        self.described += 1
        entry = self._entries.get((owner, key), 0)
        if type(entry) is CallGraph:
            if entry.first_launch is not None and not self._room_for(entry.need):
                return None
            entry.inputs = tensors
            self.replayed += 1
            if entry.guessed:
                entry.guessed = False
                self._guesses[owner[0]].discard(key)
            return entry
        if entry is None or self.held:
            return None
        if not entry and len(self._entries) >= CALLS_KEPT:
            self.clear()
        self._entries[(owner, key)] = entry + 1
        capture = entry >= 1 or (owner[0], key) in self._trusted or self._guess(owner[0], key)
        unchecked = self._unchecked.get((owner, key))
        return self.CAPTURE if capture and self._room_for(unchecked.need if unchecked else self.need) else None

    def _room_for(self, need: int) -> bool:
        """Whether a first launch that maps ``need`` bytes of the driver's graph memory fits now
        (under cudaMallocAsync: `graph_memory.fits`; the allocator's cache is emptied first where it
        holds that much more than its last emptying left). A launch short of it fails and
        keeps what it mapped for the rest of the process (bench/README.md, run 62), so a graph that
        does not fit waits, its call eager, and the plan hears how much it waits for (`waiting`)."""
        if not need or graph_memory.fits(self.device, need):
            return True
        if _cached_unused(self.device) >= self._stuck + need:
            torch.cuda.empty_cache()
            self._stuck = _cached_unused(self.device)
            if graph_memory.fits(self.device, need):
                return True
        if need > self.waiting:
            log.debug("a CUDA graph waits for %.0f MiB of free memory to launch", need / (1 << 20))
        self.waiting = max(self.waiting, need)
        return False

    def _guess(self, what: Key, key: Key) -> bool:
        """Whether a call trusted with another input signature is captured at its first call with
        ``key`` (checked by a replay like any first capture): while fewer than `GUESSES` of its
        earlier guesses wait for their first replay. A call whose signature changes at every call (a
        float among its inputs) so stops guessing after two."""
        if not any(w == what for w, _k in self._trusted):
            return False
        guesses = self._guesses.setdefault(what, set())
        if len(guesses) >= GUESSES:
            return False
        guesses.add(key)
        return True

    def capture(self, owner: tuple[Key, Key], name: str, run: Callable[..., object], args: tuple, kwargs: dict,
                reference: object, units: list[int]) -> bool:
        """Capture ``run(*args, **kwargs)`` (the call's forward, its fp8 weights cast inside)
        on static copies of the inputs, replay it on these inputs and keep it if it reproduces
        ``reference`` (the eager output of this very call) bit for bit, or at once when the call
        is trusted (`plan`); True when kept. Where its first launch does not fit yet (`_room_for`)
        the graph is kept unchecked, and a later call's capture replays it instead of recording."""
        key, tensors = describe(args, kwargs)
        trusted = (owner[0], key) in self._trusted
        out_tensors: list[torch.Tensor] = []
        out_key = describe_value(reference, out_tensors)
        io = self._static_io(key, tensors)
        failed: str | None = "the call's output is not tensors"
        entry = None
        if out_key is not None:
            outs = io.outputs.setdefault(out_key, [torch.empty_like(t) for t in out_tensors])
            entry = self._unchecked.pop((owner, key), None)
            if entry is None:
                graph, failed = self._record(run, rebuild(key[0], io.inputs), outs)
                entry = None if graph is None else CallGraph(
                    graph, io, out_key, units, self.device, guessed=key in self._guesses.get(owner[0], ()),
                    first_launch=self._took, need=graph_memory.footprint(graph))
            if entry is not None:
                self.need = max(self.need, entry.need)
                if not trusted and not self._room_for(entry.need):
                    self._unchecked[(owner, key)] = entry  # its check replay waits for room (`plan`)
                    return False
                entry.inputs = [] if trusted else tensors
                if trusted or _replays_equal(entry, outs, out_tensors):
                    self._entries[(owner, key)] = entry
                    self._trusted.add((owner[0], key))
                    self.captured += 1
                    if self.captured == 1:
                        log.info("%s: launches as a CUDA graph (inputs %s), and so will the calls captured after it", name, _shapes(tensors))
                    return True
                entry.graph.reset()
                failed = "its replay differs from the eager forward"
        self._entries[(owner, key)] = None
        self.refused += 1
        failing = out_key is not None and entry is None and not self.starved
        if failing:
            self._failing.add(owner[0])
        if self._forget_unused_pool():
            torch.cuda.empty_cache()
        said = failed.split(":")[0]
        (log.debug if said in self._said else log.info)(
            "%s: stays eager for inputs %s: %s%s", name, _shapes(tensors), failed,
            " (no more captures until the graphs are dropped)" if self.starved else
            " (not captured again, for any inputs, until a weight write)" if failing else "")
        self._said.add(said)
        return False

    def _record(self, run: Callable[..., object], call: object, outs: list[torch.Tensor]
                ) -> tuple[torch.cuda.CUDAGraph | None, str | None]:
        """The graph of ``run`` on the static inputs, writing the static outputs; or (None, why).
        A capture that runs out of memory is tried once more after the allocator's cache goes back
        to the driver: while a capture is under way the allocator cannot free the cached memory of
        the eager forwards for the graphs' pool, which is often all the room a tight card has."""
        graph, failed = self._record_once(run, call, outs)
        if graph is None and self.starved:
            self.starved, self.retried = False, self.retried + 1
            self._forget_unused_pool()
            torch.cuda.empty_cache()
            log.debug("a capture ran out of memory: the allocator's cache emptied, capturing once more")
            graph, failed = self._record_once(run, call, outs)
        return graph, failed

    def _forget_unused_pool(self) -> bool:
        """When no graph uses the pool, forget it (its memory goes back at the next empty-cache, a
        new one is made at the next capture); True when it was forgotten. A pool whose last graph
        went must not be captured into again: torch's allocators assert that a shared pool is
        still in use (under cudaMallocAsync the host allocator's assert left frees deferred:
        bench/README.md, run 69)."""
        if len(self) or self._unchecked:
            return False
        self._pool, self.pool_bytes = None, 0
        return True

    def _record_once(self, run: Callable[..., object], call: object, outs: list[torch.Tensor]
                     ) -> tuple[torch.cuda.CUDAGraph | None, str | None]:
        """One capture of ``run`` copying its outputs into ``outs``."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = self._stream or torch.cuda.Stream(self.device)
        args, kwargs = call
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        reserved = torch.cuda.memory_reserved(self.device)
        graph = graph_memory.new_graph()
        try:
            with torch.cuda.stream(self._stream):
                graph_memory.record(graph, self._pool, lambda: _copy_out(run(*args, **kwargs), outs))
        except BaseException as exc:  # any failure leaves the block eager, named in the log
            graph.reset()
            if not isinstance(exc, Exception):  # an interrupt: no graph survives a half-made pool
                self.clear()
                raise
            self.starved = isinstance(exc, torch.OutOfMemoryError)
            return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            current.wait_stream(self._stream)
            if self._pool is not None:
                self.pool_bytes += max(0, torch.cuda.memory_reserved(self.device) - reserved)
        return graph, None

    def _static_io(self, key: Key, tensors: list[torch.Tensor]) -> StaticIO:
        io = self._io.get(key)
        if io is None:
            if len(self._io) >= self.signatures:
                self.clear()
            io = self._io[key] = StaticIO([torch.empty_like(t) for t in tensors])
        return io

    def clear(self) -> None:
        """Drop every graph and static buffer (their memory goes back at the next empty-cache)."""
        for entry in [*self._entries.values(), *self._unchecked.values()]:
            if type(entry) is CallGraph:
                entry.graph.reset()
        self._entries.clear()
        self._unchecked.clear()
        self._guesses.clear()
        self._io.clear()
        self._pool, self.pool_bytes, self.starved, self.waiting = None, 0, False, 0
        if self.driver_bytes:
            self.driver_bytes = 0
            graph_memory.trim(self.device)

    def drop(self, moved: Callable[[tuple[Key, Key]], bool]) -> int:
        """Drop the graphs whose owner key ``moved`` says no longer names where its weights lie;
        how many went."""
        gone = [k for k, e in self._entries.items() if type(e) is CallGraph and moved(k[0])]
        for owner, key in gone:
            entry = self._entries.pop((owner, key))
            entry.graph.reset()
            if entry.guessed:  # never replayed: a guess less waiting (`_guess`)
                self._guesses[owner[0]].discard(key)
        unchecked = [self._unchecked.pop(k) for k in list(self._unchecked) if moved(k[0])]
        for entry in unchecked:
            entry.graph.reset()
        self._forget_unused_pool()
        return len(gone) + len(unchecked)

    def unmapped(self) -> None:
        """The driver took back its graph memory (`graph_memory.trim`): each graph maps it again at
        its next launch, a first launch again (`_room_for`)."""
        self.driver_bytes = 0
        for entry in self._entries.values():
            if type(entry) is CallGraph:
                entry.first_launch = self._took

    def forget(self) -> None:
        """`clear`, and no call is trusted any more (a weight write may change what a call runs)."""
        self.clear()
        self._trusted.clear()
        self._failing.clear()
        self.held = False

    def details(self) -> dict[str, int]:
        return {"graphs": len(self), "graph_bytes": self.nbytes, "graphs_refused": self.refused,
                "graph_retries": self.retried}


def _replays_equal(entry: CallGraph, outs: list[torch.Tensor], reference: list[torch.Tensor]) -> bool:
    """The check replay: ``entry`` run once on its inputs writes ``outs`` equal to ``reference``."""
    entry.replay()
    return all(torch.equal(a, b) for a, b in zip(outs, reference, strict=True))


def _copy_out(out: object, outs: list[torch.Tensor]) -> None:
    """Copy a captured call's output tensors into the static outputs and let them go while the
    capture is under way, so the graph frees its own allocations: under cudaMallocAsync freeing one
    outside the graph before its first launch aborts the process (bench/README.md, run 37), and
    after it warns on every free."""
    tensors: list[torch.Tensor] = []
    describe_value(out, tensors)
    for static, t in zip(outs, tensors, strict=True):
        static.copy_(t)


def _cached_unused(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _shapes(tensors: list[torch.Tensor]) -> str:
    return ", ".join("x".join(map(str, t.shape)) for t in tensors)

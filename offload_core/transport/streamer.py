"""Block streamer: the per-step transport for denoisers (vocabulary: `blocks.py`).

Why not diffusers' block-level group offload: it cannot change which blocks stay resident between steps
without re-hooking (preload needs that), it moves the non-block part from pageable memory every forward,
and it pins a second, rounded-up copy of every weight. Here the non-block part is resident; each block's
weights stay where they are in host memory, page-locked in place (copied first where they lie on a file's
mapping: `PinSet.pin_all`), as the master copy; a forward binds a unit's tensors to views of a ring buffer
(`ring.py`) filled on a side stream in *execution* order (recorded, `order.py`), and rebinds them to the
host copy after. A unit that was not prefetched loads synchronously: a wrong guess costs time, never
correctness. Any set of pieces can be kept resident between steps (``set_resident``), without re-hooking.
"""

from __future__ import annotations

import torch

from ..formats.fp8 import table_of
from ..formats.mapped import in_mapping
from ..log import get_logger
from ..pinning import PinGrant, PinSet
from .base import MARKER, STREAM_HOOK, TransportBase, TransportContext, add_hook, remove_hook
from .block_graphs import BlockGraphs
from .blocks import (
    PACK_BELOW,
    StoredDtypes,
    StreamBlock,
    StreamPiece,
    StreamUnit,
    block_tensors,
    children_streamed,
    make_block,
    make_pieces,
    move_outside,
    nbytes,
    shared_tensors,
)
from .compiled import CompiledBlocks
from .events import Events
from .graphs import CallGraph
from .head_graphs import graph_head
from .order import ExecutionOrder, OrderLearner
from .prefetch import Prefetcher
from .stream_accounts import StreamAccounts
from .stream_hooks import BlockHook, ModelEntryHook, OutsideHook, PartHook, retry_on_oom
from .stream_room import StreamRoom
from .towers import find_towers

log = get_logger("streamer")


class BlockStreamer(StreamRoom, StreamAccounts, TransportBase):
    name = "per-step"
    graphed = True  # its blocks and units may launch as CUDA graphs (`block_graphs.py`)
    compiles = True  # its blocks may run compiled (`compiled.py`)

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.device = ctx.onload_device
        self.blocks: list[StreamBlock] = []
        self.units: list[StreamUnit] = []
        self.pieces: list[StreamPiece] = []
        self.module: torch.nn.Module | None = None
        self.pins = PinSet()
        self.cuda = self.device.type == "cuda"
        self.order = ExecutionOrder([], lambda u: self.units[u].piece.resident is None)  # as the last cycle ran
        self.prefetch = Prefetcher(self.device, self.units, self.order, ctx.prefetch_window + 1, ctx.streams)
        self.ring = self.prefetch.ring
        self.learner = OrderLearner(self.order)  # ``learner.seen``: the units this forward has run
        self.stored = StoredDtypes()  # a cast after placement is refused
        self._forward_open = False  # the model was entered and its first block not yet
        self._via_model = False  # forwards come through the model's hook (else a cycle starts at the first block)
        self._hooked: list[torch.nn.Module] = []  # modules carrying STREAM_HOOK
        self._head_bytes = 0
        self._transit_peak = 0
        self.ooms = 0  # out-of-memory errors met in the hooks (torch counts none under cudaMallocAsync)
        self.events = Events()  # forward, cycle, oom, end: see events.py
        self.graphs = BlockGraphs(self.device, ctx.config.cuda_graphs and self.graphed, self.prefetch, self.notify)
        self._kept_blocks: set[int] = set()  # blocks with every piece kept: graphed whole
        self._whole: list[StreamUnit] = []  # a streaming block's units bound together (`_bind_whole`)
        self.compiled = CompiledBlocks(ctx.config.compile_blocks and self.compiles, self.device)
        self._compiling: tuple[StreamBlock, object] | None = None  # the block entered and its compiled forward

    # -- apply / remove -------------------------------------------------------------------
    def apply(self, module: torch.nn.Module) -> None:
        self.module = module
        self.graphs.model = type(module).__name__
        self.compiled.model, self.compiled.fp8 = module, table_of(module)
        towers = find_towers(module)
        tower_ids = {id(b) for t in towers for b in t.blocks}
        shared = shared_tensors(module, towers, tower_ids)
        self._move_head(module, tower_ids, self.device)
        grant = PinGrant(self.ctx.pin and self.cuda, self.block_grant())
        placed = [(tower.name, depth, block) for tower in towers for depth, block in enumerate(tower.blocks)]
        own = [[t for t in block_tensors(block) if id(t) not in shared] for _n, _d, block in placed]
        pins = [grant.claim(sum(nbytes(t) for t in tensors)) for tensors in own]
        self.pins.pin_weights([t for tensors, pin in zip(own, pins, strict=True) if pin for t in tensors
                               if nbytes(t) >= PACK_BELOW], in_mapping())  # (the small ones may go in a packet)
        for (tower, depth, block), pin in zip(placed, pins, strict=True):
            made = make_block(len(self.blocks), tower, depth, block, parts=self.ctx.stream_parts,
                              host_of=lambda t, pin=pin: self._host_master(t, pin), pinned=pin, device=self.device,
                              first_unit=len(self.units), shared=shared, fp8=table_of(module))
            self.blocks.append(made)
            self.units.extend(made.units)
            self.pieces.extend(make_pieces(made, len(self.pieces)))
        for block in self.blocks:
            self._hook(block.module, BlockHook(self, block))
            for unit in block.units if block.in_parts else ():
                self._hook(unit.module, PartHook(self, unit))
            for child in () if block.in_parts else children_streamed(block):
                self._hook(child, OutsideHook(self, block.units[0]))
        if self.graphed:
            graph_head(module, tower_ids, self.graphs.head, self._hook, self.notify)
        add_hook(module, ModelEntryHook(self), MARKER)
        slots = [slot for block in self.blocks for slot in block.slots]
        self.stored.set(slots)
        streamed = {id(slot.tensor) for slot in slots}
        self._head_bytes = sum(nbytes(t) for t in block_tensors(module) if id(t) not in streamed)
        self.order.set([u.index for u in self.units])
        self.learner.guessed = {b.tower for b in self.blocks if b.in_parts}
        self.ring.resize(self._largest_streamed())
        self.prefetch.casts.resize(max((u.cast.compute_bytes for u in self.units if u.cast), default=0))
        log.info("%s: %d blocks in %d tower(s) streamed in %d units (%.2f GiB/step, buffers of %.2f GiB, %s, %s), "
                 "non-block part resident (%.2f GiB)", type(module).__name__, len(self.blocks), len(towers),
                 len(self.units), self.streamed_bytes() / 2**30, self.ring.slot_bytes / 2**30,
                 "side-stream prefetch" if self.prefetch.copy_stream else "no stream",
                 self.prefetch.host_note(self.blocks), self.head_bytes() / 2**30)

    def retune(self, config) -> None:  # options needing no re-hooking: whether kept blocks are graphed
        self.ctx.config = config
        self.graphs.enable(config.cuda_graphs and self.graphed)
        self.compiled.enable(config.compile_blocks and self.compiles)

    def block_grant(self) -> int | None:  # the bytes its blocks may page-lock (None: all of them)
        return self.ctx.pin_bytes

    def remove(self, module: torch.nn.Module) -> None:
        self.graphs.clear(forget=True)
        self.compiled.clear()
        remove_hook(module, MARKER)
        while self._hooked:
            remove_hook(self._hooked.pop(), STREAM_HOOK)
        self.prefetch.release_all()
        for block in self.blocks:
            block.release(self.ctx.offload_device)
        for piece in self.pieces:
            piece.forget()
        self.drop_prefetched()
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.pins.release()
        self.stored.set([])
        for table in (self.blocks, self.units, self.pieces, self._kept_blocks, self._whole):
            table.clear()
        self._move_head(module, set(), self.ctx.offload_device)
        self.module = None

    def _move_head(self, module: torch.nn.Module, tower_ids: set[int], device: torch.device) -> None:
        move_outside(module, tower_ids, device)  # (the encoder streamer keeps its head home until used)

    def _hook(self, module: torch.nn.Module, hook) -> None:
        add_hook(module, hook, STREAM_HOOK)
        self._hooked.append(module)

    def _host_master(self, t: torch.Tensor, pin: bool) -> torch.Tensor:
        """The host copy a streamed tensor rests in: where it lies, page-locked in place if granted."""
        host = t.data if t.device == self.ctx.offload_device else t.data.to(self.ctx.offload_device)
        return self.pins.pin(host) if pin else host

    # -- the per-forward path (graph breaks under torch.compile: they rebind weights) -----------
    @torch.compiler.disable
    def enter_block(self, block: StreamBlock, args: tuple, kwargs: dict) -> CallGraph | None:
        """A block is entered: the model's first block entered in a forward begins a cycle (one per
        forward, whatever order the towers run in and however often); a whole block is made ready.
        A kept block's trusted CUDA graph, or a block streamed whole's graph for the buffer it is
        bound to, is returned to be replayed instead of its forward."""
        if self._forward_open or (not self._via_model and (block is self.units[self.order.first()].block
                                                           or not self.learner.seen)):
            self._forward_open = False
            self._begin_cycle(block, args, kwargs)
        elif self.learner.guessed and self.learner.learn_parts(self.units):
            self.prefetch.prefetch_after(self.units[self.learner.seen[-1]])
        self._compiling = None
        kept = block.index in self._kept_blocks
        if not block.in_parts:
            graph = self.graphs.enter(block, args, kwargs, self.learner.seen) if kept else self.enter(block.units[0], args, kwargs)
            if kept and graph is None:
                self.enter(block.units[0])  # (an fp8 block's cast)
        elif kept or self._bind_whole(block, args, kwargs):
            casts = self.compiled.forward(block) is None  # (compiled, it dequantises inside its forward)
            graph = self.graphs.enter(block, args, kwargs, self.learner.seen, casts=casts)
        else:
            return None
        if graph is None and self._compile(block) and block.in_parts:  # its parts' hooks will not run
            self.learner.seen.extend(u.index for u in self.order.sort(block.units))
        return graph

    def _compile(self, block: StreamBlock) -> bool:
        """Whether this call of ``block``, its units bound, runs its compiled forward
        (`compiled.py`; its fp8 weights are dequantised inside it, not cast by the streamer)."""
        forward = self.compiled.forward(block)
        if forward is not None:
            self._compiling = (block, forward)
        return forward is not None

    def forward_of(self, block: StreamBlock, original):
        """The forward this call of ``block`` runs: its compiled one where its entry chose it."""
        compiling = self._compiling
        return compiling[1] if compiling is not None and compiling[0] is block else original

    def _bind_whole(self, block: StreamBlock, args: tuple, kwargs: dict) -> bool:
        """A block in parts that streams is bound whole, like a kept one, where its call can be
        graphed or its forward runs compiled (a video's call, too large to graph, would otherwise
        run its parts eagerly), and its streamed parts fit the ring with a buffer to spare (the plan
        gives it a block's more, `StreamingBuffers.set_window`): every unit bound now, in execution
        order, until the block exits (True). Else its parts are bound (and graphed) one by one."""
        streamed = sum(u.piece.resident is None for u in block.units)
        if streamed >= self.ring.capacity:
            return False
        if not self.graphs.cache.wants(args, kwargs) and self.compiled.forward(block) is None:
            return False
        self._whole = self.order.sort(block.units)
        for unit in self._whole:
            retry_on_oom(lambda unit=unit: self.prefetch.bind(unit, cast=False), lambda _a: self.relieve_in(block))
        self._transit_peak = max(self._transit_peak, self.ring.nbytes)
        return True

    def _bound_whole(self, block: StreamBlock) -> bool:
        return bool(self._whole) and self._whole[0].block is block

    @torch.compiler.disable
    def exit_block(self, block: StreamBlock, output: object, forward) -> None:
        """A block's forward returned (``forward``: its forward under our hook; None when its graph
        was replayed): a block streamed whole, or bound whole, is released, and a kept or bound
        block is captured first where its entry asked for it (`block_graphs.py`)."""
        if self._bound_whole(block):
            if forward is not None:
                self.graphs.exit(block, output, forward, self.learner.seen)
            whole, self._whole = self._whole, []
            self.ooms += self.prefetch.release(*whole)
        elif block.index not in self._kept_blocks:
            if not block.in_parts:
                self.exit(block.units[0], output, forward)
        elif forward is not None:
            if not block.in_parts:
                self.exit(block.units[0])
            self.graphs.exit(block, output, forward, self.learner.seen)

    @torch.compiler.disable
    def enter(self, unit: StreamUnit, args: tuple | None = None, kwargs: dict | None = None) -> CallGraph | None:
        """A unit is entered: bound to its weights. Given its inputs (a unit of a block not kept
        whole), its graph for the buffer it is bound to is returned, to replay instead of its
        forward (an fp8 unit's weights are then cast inside the graph)."""
        if self.prefetch.capturing:  # a part of a block being captured
            self.prefetch.bind_captured(unit)
            return None
        self.learner.seen.append(unit.index)
        relieve = lambda _attempt: self.relieve_in(unit.block)  # noqa: E731
        if self._bound_whole(unit.block):  # bound at the block's entry
            if unit.cast is not None:
                retry_on_oom(lambda: self.prefetch.cast(unit), relieve)
            return None
        graphed = args is not None and unit.block.index not in self._kept_blocks
        retry_on_oom(lambda: self.prefetch.bind(unit, cast=not graphed), relieve)
        self._transit_peak = max(self._transit_peak, self.ring.nbytes)
        graph = self.graphs.enter(unit, args, kwargs, self.learner.seen) if graphed else None
        if graphed and graph is None and unit.cast is not None:
            retry_on_oom(lambda: self.prefetch.cast(unit), relieve)
        return graph

    def relieve_in(self, block: StreamBlock) -> bool:
        """An allocation inside ``block`` failed: the listeners (the planner) give kept pieces
        up, never ``block``'s; False when nothing could go."""
        self.ooms += 1
        self.graphs.clear()
        return self.notify("oom", block=block)

    @torch.compiler.disable
    def exit(self, unit: StreamUnit, output: object = None, forward=None) -> None:
        """A unit's forward returned (``forward``: its eager forward, None when replayed or not
        graphed): captured while still bound if its entry asked for it, then released."""
        if self.prefetch.capturing:
            self.prefetch.unbind_captured(unit)
            return
        if self._bound_whole(unit.block):  # released at the block's exit
            self.prefetch.uncast(unit)
            return
        if forward is not None and unit.block.index not in self._kept_blocks:
            self.graphs.exit(unit, output, forward, self.learner.seen)
        if self.prefetch.release(unit):
            self.ooms += 1

    @torch.compiler.disable
    def borrow(self, unit: StreamUnit) -> bool:
        """A layer of a whole block runs outside the block's forward: bind the block for it (True)
        unless it is bound or kept already (False)."""
        if self.prefetch.capturing or self.prefetch.ready(unit):
            return False
        retry_on_oom(lambda: self.prefetch.bind(unit), lambda _attempt: self.relieve_in(unit.block))
        return True

    @torch.compiler.disable
    def end_forward(self) -> None:
        """The model's forward returned: learn its order now, before the next forward's first
        copies are queued at its entry, and close the listeners' cycle."""
        self.learner.learn()
        self.notify("forward_end")

    def _begin_cycle(self, block: StreamBlock, args: tuple, kwargs: dict) -> None:
        self.learner.learn()
        self.learner.seen, self._whole = [], []
        self.prefetch.release_all()  # a forward that raised never reached exit()
        self.notify("cycle", block=block, args=args, kwargs=kwargs)

    def notify(self, event: str, **info) -> bool:
        """Tell listeners (the preload driver) about a cycle start, an OOM, a run end; True when
        one of them acted (an OOM was relieved)."""
        return self.events.emit(event, self, **info)

    @torch.compiler.disable
    def begin_forward(self, args: tuple, kwargs: dict) -> None:
        """The denoiser is entered: the first streamed units not in flight yet are copied, before
        the non-block part is even launched: into the buffers the ring holds, then again once the
        listeners have settled the plan (a new workload may change it; else nothing is left to
        copy). Why before: where the host waits for each step's end, the copy engine idles until
        this copy is queued (the check that no streamed weight was cast since placement reads every
        one: it runs after that first copy is queued)."""
        self._prefetch_first(made_only=True)
        self.stored.check(type(self.module).__name__)
        self._forward_open = self._via_model = True
        self.notify("forward", args=args, kwargs=kwargs)
        self._prefetch_first()

    def _prefetch_first(self, made_only: bool = False) -> None:
        try:
            self.prefetch.prefetch_after(None, made_only)
        except torch.OutOfMemoryError:  # they load at their entry instead, where an OOM is relieved
            self.ooms += 1

    # -- resident set (preload) ---------------------------------------------------------------
    def set_resident(self, indices: set[int]) -> None:
        """Keep exactly the pieces ``indices`` resident; called between forwards (no
        re-hooking). Pieces leaving go before pieces arriving, so a set that moves needs no
        room for both."""
        for piece in self.pieces:
            if piece.index not in indices and piece.resident is not None:
                piece.bind_host()
        for piece in self.pieces:
            if piece.index in indices and piece.resident is None:
                for unit in piece.units:
                    if unit.index in self.prefetch.inflight:
                        self.prefetch.discard(unit.index)
                piece.resident = self.prefetch.load_kept(piece)
        self.order.refresh()
        self._kept_blocks = self.resident_blocks()
        largest = self._largest_streamed()
        if largest != self.ring.slot_bytes:
            self.drop_prefetched()
            self.ring.resize(largest)

    def set_lookahead(self, buffers: int) -> None:
        """How many streaming buffers to fill ahead (at least the window's ``window + 1``)."""
        self.prefetch.set_buffers(max(buffers, self.ctx.prefetch_window + 1))

    def fill_ring(self) -> bool:
        """With prefetch on, make the ring's missing buffers now (`BufferRing.fill`); True if any."""
        return self.prefetch.fill()

    def relieve_outside_blocks(self, first: bool) -> bool:
        """Free memory for a forward that ran out of it outside the blocks; False when nothing can
        go. Giving the streaming buffers back (and the blocks copied into them) is tried on the
        ``first`` failure only: a forward refills them, so only giving kept blocks up, which runs
        out, may repeat."""
        self.ooms += 1
        self.graphs.clear()
        self.prefetch.release_all()
        self.learner.seen, self._whole = [], []  # the forward runs again from the start
        self._forward_open = True
        if first and self.ring.nbytes:
            self.drop_prefetched()
            return True
        return self.notify("oom", block=None)

    def after_run(self) -> None:
        """The pipeline run ended: bound units go home. The streaming buffers, and the next
        forward's first units copied into them, stay for the next run (`stream_room.py`: remade,
        every streamed unit would be captured as a CUDA graph again)."""
        self.notify("end")
        self.prefetch.release_all()
        self.learner.seen, self._whole = [], []

    def reset_peak(self) -> None:
        self._transit_peak = self.ring.nbytes
        self.prefetch.casts.reset_peak()

    def before_write(self) -> None:
        self.drop_prefetched()  # copies made ahead of a weight write would be stale
        self.compiled.clear()  # a LoRA's hooks on a layer make its block run eagerly
        self.graphs.clear(forget=True)  # a LoRA's hooks are not in them, and may change what a call runs

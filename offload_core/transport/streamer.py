"""Block streamer: the per-step transport for denoisers.

Why not diffusers' block-level group offload: it cannot change which blocks stay resident between
steps without re-hooking the model (preload needs that), it moves the non-block part blocking from
pageable memory every forward (0.4 s per Wan-14B forward in the baseline), and it pins a second,
power-of-two-rounded copy of every weight (1.57x host RAM). Here:

- the non-block part (embeddings, heads, short stacks) is resident on the device;
- each tower block keeps its weights where they already are in host memory, page-locked in place
  (`PinSet`), as the master copy; a forward binds the block's tensors to views of one flat device
  buffer and re-binds them to the host copy afterwards (the same Parameter objects throughout);
- ``window + 1`` buffers circulate: while a block computes, the next ``window`` streamed blocks in
  *execution* order (recorded, not assumed) are in flight on a side stream, and the moment a block
  exits, its buffer is handed to the streamed block after those (so a copy is queued a whole
  block earlier than at the next block's entry: when kept blocks sit between streamed ones, the
  host's launch time for them no longer delays the copy). A block that was not prefetched loads
  synchronously, so a wrong guess costs time, never correctness;
- any subset of blocks can be kept resident (``set_resident``), changed between steps;
- block buffers belong to the compute stream, so ``record_stream`` is never needed here (the
  option still applies to diffusers' leaf groups).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from diffusers.hooks import ModelHook

from ..log import get_logger
from ..pinning import PinSet
from .base import MARKER, STREAM_HOOK, MarkerHook, TransportContext, add_hook, remove_hook
from .towers import find_towers

log = get_logger("streamer")
ALIGN = 512


@dataclass
class _Slot:
    tensor: torch.Tensor  # the module's Parameter / buffer object (identity preserved)
    host: torch.Tensor  # master copy in host memory
    offset: int
    nbytes: int


@dataclass
class StreamBlock:
    index: int
    name: str
    tower: str
    depth: int
    module: torch.nn.Module
    slots: list[_Slot] = field(default_factory=list)
    nbytes: int = 0
    pinned: bool = False
    resident: torch.Tensor | None = None  # flat device buffer while kept resident

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf[s.offset : s.offset + s.nbytes].view(s.host.dtype).view(s.host.shape) for s in self.slots]

    def bind(self, tensors: list[torch.Tensor]) -> None:
        for slot, t in zip(self.slots, tensors, strict=True):
            slot.tensor.data = t

    def bind_host(self) -> None:
        for slot in self.slots:
            slot.tensor.data = slot.host


class _BlockHook(ModelHook):
    def __init__(self, streamer: BlockStreamer, block: StreamBlock) -> None:
        super().__init__()
        self.streamer, self.block = streamer, block

    def pre_forward(self, module, *args, **kwargs):
        self.streamer.enter(self.block, args, kwargs)
        return args, kwargs

    def new_forward(self, module, *args, **kwargs):
        """On an allocator OOM inside the block, let the planner give kept blocks up and retry;
        the step continues instead of failing while there is anything left to give up."""
        while True:
            try:
                return self.fn_ref.original_forward(*args, **kwargs)
            except torch.OutOfMemoryError:
                if not self.streamer.notify("oom", block=self.block):
                    raise

    def post_forward(self, module, output):
        self.streamer.exit(self.block)
        return output


class _ModelHook(MarkerHook):
    """The marker on the denoiser: announces each forward, and retries one that ran out of memory
    outside the blocks (the first forward of a larger workload allocates its inputs before the
    first block, where the plan for it is made): first without the blocks copied ahead, then with
    kept blocks given up."""

    def __init__(self, streamer: BlockStreamer) -> None:
        super().__init__(streamer.device)
        self.streamer = streamer

    def pre_forward(self, module, *args, **kwargs):
        self.streamer.notify("forward", args=args, kwargs=kwargs)
        return args, kwargs

    def new_forward(self, module, *args, **kwargs):
        attempt = 0
        while True:
            try:
                return self.fn_ref.original_forward(*args, **kwargs)
            except torch.OutOfMemoryError:
                if not self.streamer.relieve_outside_blocks(first=attempt == 0):
                    raise
            attempt += 1


class BlockStreamer:
    name = "per-step"

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.device = ctx.onload_device
        self.blocks: list[StreamBlock] = []
        self.module: torch.nn.Module | None = None
        self.pins = PinSet()
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda and ctx.use_stream else None
        self.order: list[int] = []  # execution order seen in the last cycle
        self._seen: list[int] = []
        self._inflight: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._bound: dict[int, torch.Tensor] = {}
        self._head_bytes = 0
        self._transit_peak = 0
        self.listeners: list = []  # callables(event, streamer, **info): forward, cycle, oom, end

    # -- apply / remove -------------------------------------------------------------------
    def apply(self, module: torch.nn.Module) -> None:
        self.module = module
        towers = find_towers(module)
        tower_ids = {id(b) for t in towers for b in t.blocks}
        self._head_bytes = self._move_head(module, tower_ids, self.device)
        for tower in towers:
            for depth, block in enumerate(tower.blocks):
                self.blocks.append(self._make_block(len(self.blocks), tower.name, depth, block))
        for block in self.blocks:
            add_hook(block.module, _BlockHook(self, block), STREAM_HOOK)
        add_hook(module, _ModelHook(self), MARKER)
        self.order = [b.index for b in self.blocks]
        log.info(
            "%s: %d blocks in %d tower(s) streamed (%.2f GiB/step, %s, %s), non-block part resident (%.2f GiB)",
            type(module).__name__, len(self.blocks), len(towers), self.streamed_bytes() / 2**30,
            "side-stream prefetch" if self.copy_stream else "no stream",
            "pinned" if self.ctx.pin and self.cuda else "pageable", self.head_bytes() / 2**30,
        )

    def remove(self, module: torch.nn.Module) -> None:
        remove_hook(module, MARKER)
        for block in self.blocks:
            remove_hook(block.module, STREAM_HOOK)
            block.resident = None
            block.bind_host()
        self._inflight.clear()
        self._bound.clear()
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.pins.release()
        self.blocks.clear()
        self._move_head(module, set(), self.ctx.offload_device)
        self.module = None

    def _move_head(self, module: torch.nn.Module, tower_ids: set[int], device: torch.device) -> int:
        """Move every tensor outside the tower blocks to ``device``; return their bytes."""
        total = 0
        for sub in _modules_outside(module, tower_ids):
            for t in (*sub._parameters.values(), *sub._buffers.values()):
                if t is not None:
                    if t.device != device:
                        t.data = t.data.to(device)
                    total += t.numel() * t.element_size()
        return total

    def _make_block(self, index: int, tower: str, depth: int, module: torch.nn.Module) -> StreamBlock:
        block = StreamBlock(index, f"{tower}.{depth}", tower, depth, module)
        seen: set[int] = set()
        offset = 0
        for t in (*module.parameters(), *module.buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            host = t.data if t.device == self.ctx.offload_device else t.data.to(self.ctx.offload_device)
            if self.ctx.pin:
                host = self.pins.pin(host)
            t.data = host
            nbytes = host.numel() * host.element_size()
            block.slots.append(_Slot(t, host, offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        block.nbytes = offset
        block.pinned = self.ctx.pin and self.cuda
        return block

    # -- the per-forward path ---------------------------------------------------------------
    def enter(self, block: StreamBlock, args: tuple, kwargs: dict) -> None:
        if block.index == self.order[0] or not self._seen:
            self._begin_cycle(block, args, kwargs)
        self._seen.append(block.index)
        while True:
            try:
                return self._make_ready(block)
            except torch.OutOfMemoryError:  # our own buffer did not fit: give kept blocks up
                if not self.notify("oom", block=block):
                    raise

    def _make_ready(self, block: StreamBlock) -> None:
        if block.resident is None and block.index not in self._bound:
            buf = self._take(block)
            self._bound[block.index] = buf
            block.bind(block.views(buf))
        self._prefetch_after(block)

    def exit(self, block: StreamBlock) -> None:
        if self._bound.pop(block.index, None) is not None:
            block.bind_host()
            # Its buffer's next user. On an OOM that block loads at its entry instead, where an
            # OOM gives kept blocks up.
            with contextlib.suppress(torch.OutOfMemoryError):
                self._prefetch_after(block, wrap=False)

    def _unbind_all(self) -> None:
        for index in list(self._bound):
            del self._bound[index]
            self.blocks[index].bind_host()

    def _begin_cycle(self, block: StreamBlock, args: tuple, kwargs: dict) -> None:
        if len(self._seen) >= len(self.order) // 2 and self._seen:
            self.order = _dedupe(self._seen)
        self._seen = []
        self._unbind_all()  # a forward that raised never reached exit()
        self.notify("cycle", block=block, args=args, kwargs=kwargs)

    def notify(self, event: str, **info) -> bool:
        """Tell listeners (the preload driver) about a cycle start, an OOM, a run end; True when
        one of them acted (an OOM was relieved)."""
        return any([bool(listener(event, self, **info)) for listener in self.listeners])

    def _take(self, block: StreamBlock) -> torch.Tensor:
        entry = self._inflight.pop(block.index, None)
        if entry is None:
            entry = self._load(block)
        buf, ready = entry
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return buf

    def _prefetch_after(self, block: StreamBlock, wrap: bool = True) -> None:
        """Keep exactly the next streamed blocks after ``block`` in flight that fill the
        ``window + 1`` buffers with the one bound now, if any. Without ``wrap``, none of the next
        forward's: the extra buffer would stay through the non-block tail and the next head,
        where a large workload's activations peak."""
        if self.copy_stream is None:
            return
        count = self.ctx.prefetch_window + 1 - len(self._bound)
        upcoming = self._upcoming(block.index, count, wrap)
        if not wrap:
            upcoming = [*upcoming, *(i for i in self._inflight if i not in upcoming)][:count]
        for index in list(self._inflight):
            if index not in upcoming:
                self._discard(index)  # a skipped branch, a changed plan
        for index in upcoming:
            if index not in self._inflight:
                self._inflight[index] = self._load(self.blocks[index])
        self._transit_peak = max(self._transit_peak, self._transit_bytes())

    def _upcoming(self, index: int, count: int, wrap: bool = True) -> list[int]:
        order = self.order
        pos = order.index(index) if index in order else -1
        out: list[int] = []
        for step in range(1, len(order) + 1):
            nxt = order[(pos + step) % len(order)]
            if nxt == index or len(out) >= count or (not wrap and pos + step >= len(order)):
                break
            if self.blocks[nxt].resident is None:
                out.append(nxt)
        return out

    def _load(self, block: StreamBlock) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Copy a block into a fresh flat buffer. The buffer comes from the *compute* stream's
        pool (one pool: no memory cached per stream, so a tight card does not make the allocator
        flush and retry), and the side stream first waits for the compute work queued so far,
        which may still read memory the allocator just handed out: at most the block that has
        just exited, whose buffer this usually is, so the copy still overlaps what runs next."""
        buf = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)
        stream = self.copy_stream
        if stream is None:
            for dst, slot in zip(block.views(buf), block.slots, strict=True):
                dst.copy_(slot.host)
            return buf, None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for dst, slot in zip(block.views(buf), block.slots, strict=True):
                dst.copy_(slot.host, non_blocking=block.pinned)
            ready = stream.record_event()
        return buf, ready

    # -- resident set (preload) ---------------------------------------------------------------
    def set_resident(self, indices: set[int]) -> None:
        """Keep exactly ``indices`` resident; called between forwards (no re-hooking)."""
        for block in self.blocks:
            keep = block.index in indices
            if keep and block.resident is None:
                if block.index in self._inflight:
                    self._discard(block.index)
                buf, ready = self._load(block)
                if ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(ready)
                block.resident = buf
                block.bind(block.views(buf))
            elif not keep and block.resident is not None:
                block.bind_host()
                block.resident = None

    def relieve_outside_blocks(self, first: bool) -> bool:
        """Free memory for a forward that ran out of it outside the blocks; False when nothing can
        go. Dropping the blocks copied ahead is tried on the ``first`` failure only: a forward
        refills them, so only giving kept blocks up, which runs out, may repeat."""
        self._unbind_all()
        self._seen = []  # the forward runs again from the start
        if first and self._inflight:
            self.drop_prefetched()
            return True
        return self.notify("oom", block=None)

    def drop_prefetched(self) -> None:
        """Forget the blocks copied ahead: they would be stale after a write to the host copies."""
        for index in list(self._inflight):
            self._discard(index)

    def _discard(self, index: int) -> None:
        """Give a prefetched buffer back to the pool. Its copy may still be running on the side
        stream, and the pool hands memory out in compute-stream order: the compute stream waits
        for the copy first, or the next activation placed there would be overwritten."""
        _buf, ready = self._inflight.pop(index)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def resident_indices(self) -> set[int]:
        return {b.index for b in self.blocks if b.resident is not None}

    def after_run(self) -> None:
        """Drop prefetched buffers at the end of a pipeline run (nothing runs the next block)."""
        self.notify("end")
        self.drop_prefetched()
        self._unbind_all()
        self._seen = []

    def weights_at_peak(self) -> int:
        """Weight bytes on the device when the allocator peaked: the resident part plus the most
        streamed-block buffers that were alive at once this cycle (the peak happens inside a block,
        with its successor prefetched)."""
        kept = sum(b.nbytes for b in self.blocks if b.resident is not None)
        return self._head_bytes + kept + self._transit_peak

    def reset_peak(self) -> None:
        self._transit_peak = self._transit_bytes()

    def _transit_bytes(self) -> int:
        return sum(b.numel() for b in self._bound.values()) + sum(e[0].numel() for e in self._inflight.values())

    # -- accounting -------------------------------------------------------------------------
    def head_bytes(self) -> int:
        return self._head_bytes

    def streamed_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks if b.resident is None)

    def device_bytes(self) -> int:
        """Weights on the device now: the resident part, kept and bound blocks, prefetched buffers
        (read from the block table, not by walking every tensor: it runs once per forward)."""
        if self.module is None or self.device == self.ctx.offload_device:
            return 0
        kept = sum(b.nbytes for b in self.blocks if b.resident is not None)
        return self._head_bytes + kept + self._transit_bytes()

    def pinned_bytes(self) -> int:
        return self.pins.nbytes

    def give_back(self, nbytes: int) -> int:
        """Release kept blocks, deepest-ranked last kept first, until ``nbytes`` are freed."""
        freed = 0
        kept = [b for b in reversed(self.blocks) if b.resident is not None]
        keep = self.resident_indices()
        for block in kept:
            if freed >= nbytes:
                break
            keep.discard(block.index)
            freed += block.nbytes
        self.set_resident(keep)
        return freed

    def run_bytes(self) -> int:
        """The streaming slots: the block being run plus the prefetch window."""
        streamed = [b.nbytes for b in self.blocks if b.resident is None]
        return (self.ctx.prefetch_window + 1) * max(streamed, default=0)

    def details(self) -> dict[str, object]:
        return {
            "blocks": len(self.blocks),
            "kept": len(self.resident_indices()),
            "streamed_per_step": self.streamed_bytes(),
            "stream": self.copy_stream is not None,
            "window": self.ctx.prefetch_window,
        }


def _modules_outside(root: torch.nn.Module, skip: set[int]):
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in skip:
            continue
        yield module
        stack.extend(module.children())


def _dedupe(seq: list[int]) -> list[int]:
    return list(dict.fromkeys(seq))

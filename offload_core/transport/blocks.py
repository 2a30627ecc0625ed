"""The block streamer's table, and the vocabulary the streamer and the planner share:

- a **block**: one entry of a tower (a repeated stack: ``transformer_blocks``, ``blocks``);
- a **part**: a large child of a block (an attention, a feed-forward: at least 1/8 of the
  block's bytes); with ``stream_parts`` a block that splits well streams part by part, each part
  bound only while its forward runs, and the rest (norms, scale tables) stays resident;
- a **unit**: what moves to the device as one: a whole block, or one part;
- a **piece**: what the preload plan keeps or streams as one: a whole block, or, of a block in
  parts, its largest part (the core) or the rest of its parts.
- a **packet**: a unit's small tensors' host masters (pinned masters only) in one buffer laid out
  as on the device, copied as one.
Why parts: the streaming buffers are sized to the largest unit, so smaller units leave more
room for kept blocks on a small card. A block whose rest would be large streams whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter

import torch

from ..formats.fp8 import Fp8Table
from .cast import UnitCast, unit_cast

ALIGN = 512
PART_FRACTION = 8  # a child of at least 1/8 of its block's bytes streams as its own part
REST_FRACTION = 16  # a block streams in parts only if what stays resident is at most 1/16 of it
PACK_BELOW = 1 << 20  # a pinned unit's tensors under this size are copied as one packet (`StreamUnit.packet`)

_DTYPE = attrgetter("dtype")

@dataclass
class TensorSlot:
    tensor: torch.Tensor  # the module's Parameter / buffer object (identity preserved)
    host: torch.Tensor  # master copy in host memory
    offset: int  # in the block's flat layout
    nbytes: int

    def view(self, buf: torch.Tensor, base: int) -> torch.Tensor:
        """This tensor in ``buf``, a buffer whose byte 0 is the layout's byte ``base``."""
        start = self.offset - base
        return buf[start : start + self.nbytes].view(self.host.dtype).view(self.host.shape)


@dataclass(eq=False)
class StreamUnit:
    """Tensors that move together; they lie in ``[start, start + nbytes)`` of their block's
    flat layout. ``module``: the module whose forward binds them (the block, or a child)."""

    index: int  # position in the streamer's unit table
    block: StreamBlock
    module: torch.nn.Module
    slots: list[TensorSlot]
    start: int
    nbytes: int
    piece: StreamPiece | None = None  # what the preload plan keeps or streams it with
    cast: UnitCast | None = None  # its fp8 weights' cast to compute values (`cast.py`), if any
    kept: torch.Tensor | None = None  # its bytes in its piece's device buffer while kept
    kept_views: list[torch.Tensor] | None = None  # its tensors there
    computed: bool = False  # kept as compute values, its fp8 weights cast once (`held_casts.py`)
    packet: torch.Tensor | None = None  # the host masters of its last `packed` slots, laid out as on the device
    packed: int = 0

    @property
    def single(self) -> int:
        """How many of its slots (the first) are copied one by one; the rest lie in its packet."""
        return len(self.slots) - self.packed

    @cached_property
    def copy_bytes(self) -> int:
        """What a copy of it from its host masters moves: its tensors' bytes (``nbytes`` less
        the alignment gaps), its packet whole (the gaps between its tensors too)."""
        packet = 0 if self.packet is None else self.packet.numel()
        return sum(slot.nbytes for slot in self.slots[: self.single]) + packet

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The unit's tensors as views of ``buf``, a buffer holding this unit alone."""
        return [slot.view(buf, self.start) for slot in self.slots]

    def copy_pairs(self, views: list[torch.Tensor], buf: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device region, host source) pairs that copy the unit into ``buf`` (holding it alone;
        ``views`` as `views` made them): one per tensor, its packet as one."""
        single = self.single
        pairs = [(view, slot.host) for view, slot in zip(views[:single], self.slots[:single], strict=True)]
        if self.packet is not None:
            at = self.slots[single].offset - self.start
            pairs.append((buf[at : at + self.packet.numel()], self.packet))
        return pairs

    def bind(self, views: list[torch.Tensor]) -> None:
        """Bind the tensors to ``views`` (as made by `views`, in slot order)."""
        for slot, view in zip(self.slots, views, strict=True):
            slot.tensor.data = view

    def bind_host(self) -> None:
        for slot in self.slots:
            slot.tensor.data = slot.host


@dataclass(eq=False)
class StreamBlock:
    index: int
    name: str
    tower: str
    depth: int
    module: torch.nn.Module
    slots: list[TensorSlot] = field(default_factory=list)
    units: list[StreamUnit] = field(default_factory=list)
    nbytes: int = 0
    rest_bytes: int = 0  # resident beside the non-block part (blocks streamed in parts)
    pinned: bool = False

    @property
    def in_parts(self) -> bool:
        return self.units[0].module is not self.module

    @property
    def largest_unit(self) -> int:
        return max(u.nbytes for u in self.units)

    def release(self, offload_device: torch.device) -> None:
        """Back to the host masters for good (pageable copies of those in a packet), except a
        weight the user cast after placement, which stays cast (moved to ``offload_device``): a
        release never restores a stale dtype."""
        for unit in self.units:
            for slot in unit.slots[unit.single :]:  # out of the pinned packet
                slot.host = torch.empty_like(slot.host, pin_memory=False).copy_(slot.host)
            unit.packet, unit.packed = None, 0
        for slot in self.slots:
            cast = slot.tensor.dtype != slot.host.dtype
            slot.tensor.data = slot.tensor.data.to(offload_device) if cast else slot.host


@dataclass(eq=False)
class StreamPiece:
    """What the preload plan keeps resident or streams as one: a whole block, or, of a block
    streamed in parts, its largest part (the ``core``) or the rest of its parts.

    Why split a block in two for the plan: a block streamed in parts whose whole does not fit
    the streaming buffers waits for its own largest part's copy, which can start only when its
    first part's buffer frees. Keeping the cores resident first and streaming only the rest, the
    buffers hold a streamed block's whole rest, in smaller slots."""

    index: int  # position in the streamer's piece table; the planner speaks in these
    block: StreamBlock
    units: list[StreamUnit]
    core: bool
    resident: torch.Tensor | None = None  # its device buffer while kept: its units one after another

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def largest_unit(self) -> int:
        return max(u.nbytes for u in self.units)

    def views(self, buf: torch.Tensor) -> list[list[torch.Tensor]]:
        """Each unit's tensors as views of ``buf``, a buffer holding this piece."""
        out, offset = [], 0
        for unit in self.units:
            out.append(unit.views(buf[offset : offset + unit.nbytes]))
            offset += unit.nbytes
        return out

    def bind_host(self) -> None:
        """The piece is no longer kept: its units back to their host masters."""
        for unit in self.units:
            unit.bind_host()
        self.forget()

    def forget(self) -> None:
        """Drop every reference to its device buffer. At a release the units and the hooks form
        cycles that only a garbage collection breaks (ComfyUI's unload runs none): a buffer one
        of them still held would stay on the device after the release."""
        for unit in self.units:
            unit.kept = unit.kept_views = None
            unit.computed = False
        self.resident = None


def make_pieces(block: StreamBlock, first_index: int) -> list[StreamPiece]:
    """The block as the plan sees it: whole, or (in parts) its core, then the rest."""
    if len(block.units) < 2:
        pieces = [StreamPiece(first_index, block, list(block.units), core=False)]
    else:
        core = max(block.units, key=lambda u: u.nbytes)
        rest = [u for u in block.units if u is not core]
        pieces = [StreamPiece(first_index, block, [core], core=True),
                  StreamPiece(first_index + 1, block, rest, core=False)]
    for piece in pieces:
        for unit in piece.units:
            unit.piece = piece
    return pieces


def make_block(index: int, tower: str, depth: int, module: torch.nn.Module, *, parts: bool,
               host_of: Callable[[torch.Tensor], torch.Tensor], pinned: bool, device: torch.device,
               first_unit: int, shared: frozenset[int] = frozenset(), fp8: Fp8Table | None = None) -> StreamBlock:
    """Lay ``module``'s tensors out flat, one unit after another, each unit's fp8 weights (of
    ``fp8``) first (``host_of`` gives each tensor its host master copy, ``pinned`` says whether
    those are page-locked); with ``parts``, a block that splits well keeps its rest on
    ``device``. Tensors in ``shared`` (ids of tensors other blocks or the non-block part use
    too) stay on ``device`` whatever the block does."""
    block = StreamBlock(index, f"{tower}.{depth}", tower, depth, module, pinned=pinned)
    if parts:
        pieces, rest = _pieces(module, shared)
    else:
        pieces = [(module, [t for t in block_tensors(module) if id(t) not in shared])]
        rest = [t for t in block_tensors(module) if id(t) in shared]
    for t in rest:
        t.data = t.data.to(device)
    block.rest_bytes = sum(nbytes(t) for t in rest if id(t) not in shared)
    offset = 0

    def small(t: torch.Tensor) -> bool:  # may be copied in the unit's packet, not alone
        return pinned and type(t.data) is torch.Tensor and nbytes(t) < PACK_BELOW and not (fp8 and fp8.holds(t))

    for owner, tensors in pieces:
        packed = {id(t) for t in tensors if small(t)}
        packed = packed if len(packed) > 1 else set()  # one alone is a copy either way: its master as the others'
        tensors = sorted(tensors, key=lambda t: (id(t) in packed, not (fp8 and fp8.holds(t))))  # fp8 first, packed last
        start = offset
        slots = []
        fp8_end = 0
        for t in tensors:
            host = t.data.cpu() if id(t) in packed else host_of(t)
            t.data = host
            slots.append(TensorSlot(t, host, offset, nbytes(host)))
            offset += -(-nbytes(host) // ALIGN) * ALIGN
            if fp8 is not None and fp8.holds(t):
                fp8_end = offset - start
        unit = StreamUnit(first_unit + len(block.units), block, owner, slots, start, offset - start)
        if packed:
            _pack(unit, len(packed))
        unit.cast = unit_cast(fp8, [s.tensor for s in slots], [s.offset - start for s in slots], fp8_end)
        block.units.append(unit)
        block.slots.extend(slots)
    block.nbytes = offset
    return block


def _pack(unit: StreamUnit, count: int) -> None:
    """The unit's last ``count`` slots get their host masters in one pinned packet laid out as
    on the device, so that one copy moves them. Why: a copy of a small tensor costs a few
    microseconds of the copy engine whatever its size (bench/README.md, run 44)."""
    first = unit.slots[-count]
    packet = torch.empty(unit.start + unit.nbytes - first.offset, dtype=torch.uint8,
                         pin_memory=torch.cuda.is_available())
    for slot in unit.slots[-count:]:
        view = slot.view(packet, first.offset)
        view.copy_(slot.host)
        slot.host = slot.tensor.data = view
    unit.packet, unit.packed = packet, count


def _pieces(block: torch.nn.Module, shared: frozenset[int]
            ) -> tuple[list[tuple[torch.nn.Module, list[torch.Tensor]]], list[torch.Tensor]]:
    """(the large children with their tensors, the rest); the whole block as one piece and
    ``shared`` as the rest when it does not split well (no large child, tensors shared between
    children or with others, a large rest)."""
    everything = block_tensors(block)
    total = sum(nbytes(t) for t in everything)
    owners: dict[int, int] = {}
    children = [child for _name, child in block.named_children()]
    for child in children:
        for t in block_tensors(child):
            owners[id(t)] = owners.get(id(t), 0) + 1
    large = [c for c in children if sum(nbytes(t) for t in block_tensors(c)) * PART_FRACTION >= total
             and all(owners[id(t)] == 1 and id(t) not in shared for t in block_tensors(c))]
    moved = {id(t) for c in large for t in block_tensors(c)}
    rest = [t for t in everything if id(t) not in moved]
    if not large or sum(nbytes(t) for t in rest) * REST_FRACTION > total:
        return [(block, [t for t in everything if id(t) not in shared])], [t for t in everything if id(t) in shared]
    return [(c, block_tensors(c)) for c in large], rest


def block_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return list({id(t): t for t in (*module.parameters(), *module.buffers())}.values())


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shared_tensors(module: torch.nn.Module, towers, tower_ids: set[int]) -> frozenset[int]:
    """Ids of the tensors that more than one block, or a block and the non-block part, hold:
    they stay on the device (each block rebinds only its own weights)."""
    owners: dict[int, int] = {}
    for tower in towers:
        for block in tower.blocks:
            for t in block_tensors(block):
                owners[id(t)] = owners.get(id(t), 0) + 1
    head = {id(t) for sub in modules_outside(module, tower_ids)
            for t in (*sub._parameters.values(), *sub._buffers.values()) if t is not None}
    return frozenset(i for i, n in owners.items() if n > 1 or i in head)


def children_streamed(block: StreamBlock) -> list[torch.nn.Module]:
    """The direct children of a whole block that hold streamed weights: a pipeline may call one
    of them outside the block's forward."""
    mine = {id(slot.tensor) for slot in block.slots}
    return [c for c in block.module.children() if any(id(t) in mine for t in block_tensors(c))]


def move_outside(module: torch.nn.Module, tower_ids: set[int], device: torch.device) -> None:
    """Move every tensor outside the tower blocks (ids ``tower_ids``) to ``device``."""
    for sub in modules_outside(module, tower_ids):
        for t in (*sub._parameters.values(), *sub._buffers.values()):
            if t is not None and t.device != device:
                t.data = t.data.to(device)


def modules_outside(root: torch.nn.Module, skip: set[int]):
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in skip:
            continue
        yield module
        stack.extend(module.children())


class StoredDtypes:
    """The streamed tensors' stored dtypes, checked at each forward's entry: a weight cast after
    placement (``model.to(dtype)``, layerwise casting) would be overwritten by the next copy from
    its master, so it is refused, naming what to do (one C-level pass over the tensors)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.dtypes: list[torch.dtype] = []  # what each must be now
        self._stored: list[torch.dtype] = []
        self._at: dict[int, int] = {}

    def set(self, slots: list[TensorSlot]) -> None:
        self.tensors, self.dtypes = [s.tensor for s in slots], [s.host.dtype for s in slots]
        self._stored = list(self.dtypes)
        self._at = {id(t): i for i, t in enumerate(self.tensors)}

    def expect(self, tensors: list[torch.Tensor], dtype: torch.dtype | None) -> None:
        """``tensors`` are bound to values of ``dtype`` by the streamer itself (None: their stored
        dtype again)."""
        for t in tensors:
            i = self._at[id(t)]
            self.dtypes[i] = dtype or self._stored[i]

    def check(self, owner: str) -> None:
        if list(map(_DTYPE, self.tensors)) != self.dtypes:
            tensor, stored = next((t, d) for t, d in zip(self.tensors, self.dtypes, strict=True) if t.dtype != d)
            raise RuntimeError(
                f"{owner}: streamed weights were cast after placement ({stored} -> {tensor.dtype}): cast the "
                "model before placing it, or release it and place it again")

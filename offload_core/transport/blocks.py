"""The block streamer's table, and the vocabulary the streamer and the planner share:

- a **block**: one entry of a tower (a repeated stack: ``transformer_blocks``, ``blocks``);
- a **part**: a large child of a block (an attention, a feed-forward: at least 1/8 of the
  block's bytes); with ``stream_parts`` a block that splits well streams part by part, each part
  bound only while its forward runs, and the rest (norms, scale tables) stays resident;
- a **unit**: what moves to the device as one: a whole block, or one part;
- a **piece**: what the preload plan keeps or streams as one: a whole block, or, of a block in
  parts, its largest part (the core) or the rest of its parts.
Why parts: the streaming buffers are sized to the largest unit, so smaller units leave more
room for kept blocks on a small card. A block whose rest would be large streams whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ALIGN = 512
PART_FRACTION = 8  # a child of at least 1/8 of its block's bytes streams as its own part
REST_FRACTION = 16  # a block streams in parts only if what stays resident is at most 1/16 of it


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

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The unit's tensors as views of ``buf``, a buffer holding this unit alone."""
        return [slot.view(buf, self.start) for slot in self.slots]

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

    def bind_host(self) -> None:
        for slot in self.slots:
            slot.tensor.data = slot.host


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
        for unit in self.units:
            unit.bind_host()


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
               first_unit: int) -> StreamBlock:
    """Lay ``module``'s tensors out flat, one unit after another (``host_of`` gives each its
    host master copy, ``pinned`` says whether those are page-locked); with ``parts``, a block
    that splits well keeps its rest on ``device``."""
    block = StreamBlock(index, f"{tower}.{depth}", tower, depth, module, pinned=pinned)
    pieces, rest = _pieces(module) if parts else ([(module, _tensors(module))], [])
    for t in rest:
        t.data = t.data.to(device)
        block.rest_bytes += _nbytes(t)
    offset = 0
    for owner, tensors in pieces:
        start = offset
        slots = []
        for t in tensors:
            host = host_of(t)
            t.data = host
            slots.append(TensorSlot(t, host, offset, _nbytes(host)))
            offset += -(-_nbytes(host) // ALIGN) * ALIGN
        block.units.append(StreamUnit(first_unit + len(block.units), block, owner, slots, start, offset - start))
        block.slots.extend(slots)
    block.nbytes = offset
    return block


def _pieces(block: torch.nn.Module) -> tuple[list[tuple[torch.nn.Module, list[torch.Tensor]]], list[torch.Tensor]]:
    """(the large children with their tensors, the rest); the whole block as one piece and no
    rest when it does not split well (no large child, shared tensors, a large rest)."""
    everything = _tensors(block)
    total = sum(_nbytes(t) for t in everything)
    owners: dict[int, int] = {}
    children = [child for _name, child in block.named_children()]
    for child in children:
        for t in _tensors(child):
            owners[id(t)] = owners.get(id(t), 0) + 1
    large = [c for c in children if sum(_nbytes(t) for t in _tensors(c)) * PART_FRACTION >= total
             and all(owners[id(t)] == 1 for t in _tensors(c))]
    moved = {id(t) for c in large for t in _tensors(c)}
    rest = [t for t in everything if id(t) not in moved]
    if not large or sum(_nbytes(t) for t in rest) * REST_FRACTION > total:
        return [(block, everything)], []
    return [(c, _tensors(c)) for c in large], rest


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return list({id(t): t for t in (*module.parameters(), *module.buffers())}.values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

"""The streaming buffers a plan holds (`preload/buffers.py`): counted in units, or in pieces
where a piece's units are bound together; their size the largest streamed piece's slot; the
lookahead's room and what a shortage gives up."""

from __future__ import annotations

from diffusers_offload.offload_core.preload.buffers import StreamingBuffers

MB = 1 << 20


def _buffers(whole: bool, window: int = 1) -> StreamingBuffers:
    """Three pieces: a core (slot 40 MB), a rest of four units (slot 30 MB), a whole block (100 MB)."""
    buffers = StreamingBuffers({0: 40 * MB, 1: 30 * MB, 2: 100 * MB}, units=4)
    buffers.set_window(window, whole)
    return buffers


def test_bound_whole_the_window_counts_pieces_else_units() -> None:
    assert (_buffers(False).base, _buffers(False).most) == (2, 5)  # the unit running and one more; a block ahead
    assert (_buffers(True).base, _buffers(True).most) == (8, 8)  # the rest bound and the next rest
    assert _buffers(True, window=2).base == 12 and _buffers(False, window=2).base == 3
    assert _buffers(True).count == 8


def test_a_buffer_is_the_largest_slot_left_streaming() -> None:
    buffers = _buffers(False)
    assert buffers.slot(set()) == 100 * MB and buffers.slot({2}) == 40 * MB and buffers.slot({0, 1, 2}) == 0
    assert buffers.reserved({2}) == 2 * 40 * MB and buffers.held({2}) == 2 * 40 * MB


def test_room_buys_buffers_up_to_most_and_a_shortage_gives_those_back() -> None:
    buffers = _buffers(False)
    kept = 100 * MB
    assert buffers.for_room(kept, kept + 3 * 40 * MB + MB, {2}) == 3
    assert buffers.for_room(kept, kept + 40 * 40 * MB, {2}) == 5  # no more than a block ahead
    assert buffers.for_room(kept, kept, {2}) == 2  # never fewer than the window's
    buffers.count = 4
    assert buffers.beyond_base({2}) == 2 * 40 * MB and buffers.held({2}) == 4 * 40 * MB
    buffers.count = buffers.base
    assert buffers.beyond_base({2}) == 0

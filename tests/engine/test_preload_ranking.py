"""Preload order: unpinnable first, then non-tower blocks, then towers spread over depth and
sharing ranks in proportion to their bytes; and the kept set's streamed blocks spread evenly."""

from itertools import pairwise

import pytest
from diffusers_offload.offload_core.preload.ranking import BlockInfo, rank_blocks, spread_kept


def tower(name: str, count: int, nbytes: int = 100, start: int = 0) -> list[BlockInfo]:
    return [BlockInfo(start + d, name, d, nbytes) for d in range(count)]


def max_gap(depths: list[int], count: int) -> int:
    """Longest run of depths not chosen, counting the stack's two ends."""
    edges = [-1, *sorted(depths), count]
    return max(b - a - 1 for a, b in pairwise(edges))


def test_every_block_ranked_once():
    blocks = [BlockInfo(0, None, 0, 5), *tower("a", 13, start=1), *tower("b", 7, start=14)]
    assert sorted(rank_blocks(blocks)) == list(range(21))


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13, 40, 50, 64, 100])
def test_every_prefix_is_spread_over_the_depth(count):
    order = rank_blocks(tower("t", count))
    for k in range(1, count + 1):
        # a prefix of k blocks covers the stack at least as well as k/2 evenly spaced blocks
        assert max_gap(order[:k], count) <= 2 * count // k + 1, (k, sorted(order[:k]))


def test_first_blocks_of_a_tower_are_far_apart():
    order = rank_blocks(tower("t", 40))
    assert sorted(order[:4]) == [0, 10, 20, 30]


def test_non_tower_blocks_come_before_towers_in_table_order():
    blocks = [*tower("t", 6, start=0), BlockInfo(9, None, 0, 1), BlockInfo(6, None, 0, 1 << 30)]
    assert rank_blocks(blocks)[:2] == [6, 9]


def test_unpinnable_blocks_come_first_of_all():
    blocks = [
        BlockInfo(0, None, 0, 10),
        *tower("t", 8, start=1),
        BlockInfo(9, "t", 8, 100, pinnable=False),
        BlockInfo(10, None, 0, 10, pinnable=False),
    ]
    order = rank_blocks(blocks)
    assert order[:3] == [10, 9, 0]  # unpinnable (non-tower, tower), then the pinnable non-tower


@pytest.mark.parametrize(
    ("a", "b"),
    [((40, 100), (10, 100)), ((30, 100), (10, 300)), ((48, 50), (12, 400))],
)
def test_towers_share_ranks_in_proportion_to_their_bytes(a, b):
    (count_a, size_a), (count_b, size_b) = a, b
    blocks = [*tower("a", count_a, size_a), *tower("b", count_b, size_b, start=count_a)]
    order = rank_blocks(blocks)
    total_a, total_b = count_a * size_a, count_b * size_b
    step = max(size_a / total_a, size_b / total_b)  # one block's share of its tower
    taken_a = taken_b = 0
    for index in order:
        if index < count_a:
            taken_a += size_a
        else:
            taken_b += size_b
        assert abs(taken_a / total_a - taken_b / total_b) <= step + 1e-9


def test_each_tower_stays_spread_when_interleaved():
    blocks = [*tower("a", 40), *tower("b", 20, start=40)]
    order = rank_blocks(blocks)
    depths_b = [i - 40 for i in order if i >= 40]
    for k in range(1, 21):
        assert max_gap(depths_b[:k], 20) <= 2 * 20 // k + 1


def streamed_gaps(kept: frozenset[int], depths: range) -> list[int]:
    """Kept blocks between consecutive streamed ones, around the stack (the forward repeats)."""
    streamed = [d for d in depths if d not in kept]
    wrapped = [*streamed, streamed[0] + len(depths)]
    return [b - a - 1 for a, b in pairwise(wrapped)]


@pytest.mark.parametrize("count", [7, 16, 40, 48])
def test_spread_kept_streams_evenly_at_every_count(count):
    blocks = tower("t", count)
    order = rank_blocks(blocks)
    for k in range(count):
        kept = spread_kept(frozenset(order[:k]), blocks)
        gaps = streamed_gaps(kept, range(count))
        assert len(kept) == k and max(gaps) - min(gaps) <= 1, (k, gaps)


def test_spread_kept_keeps_each_towers_count_and_leaves_the_rest():
    blocks = [BlockInfo(0, None, 0, 5), *tower("a", 20, start=1), *tower("b", 10, nbytes=300, start=21)]
    order = rank_blocks(blocks)
    prefix = frozenset(order[:18])
    kept = spread_kept(prefix, blocks)
    for lo, hi in ((0, 1), (1, 21), (21, 31)):
        assert len(kept & set(range(lo, hi))) == len(prefix & set(range(lo, hi)))
    gaps = streamed_gaps(frozenset(i - 1 for i in kept if 1 <= i < 21), range(20))
    assert max(gaps) - min(gaps) <= 1


def test_spread_kept_leaves_towers_of_mixed_or_unpinnable_blocks_as_ranked():
    mixed = [*tower("t", 7), BlockInfo(7, "t", 7, 999)]
    pinned_not = [*tower("t", 7), BlockInfo(7, "t", 7, 100, pinnable=False)]
    for blocks in (mixed, pinned_not):
        prefix = frozenset(rank_blocks(blocks)[:5])
        assert spread_kept(prefix, blocks) == prefix


def test_cores_rank_before_any_rest_and_each_kind_spreads_apart():
    """A block streamed in parts is two entries: its largest part (core) and the rest."""
    blocks = [BlockInfo(2 * d + r, "t", d, 100 if r else 140, core=not r) for d in range(8) for r in (0, 1)]
    order = rank_blocks(blocks)
    assert all(blocks[i].core for i in order[:8]) and not any(blocks[i].core for i in order[8:])
    kept = spread_kept(frozenset(order[:11]), blocks)  # all cores, three rests
    assert {i for i in kept if blocks[i].core} == set(order[:8])
    rests = frozenset(blocks[i].depth for i in kept if not blocks[i].core)
    gaps = streamed_gaps(rests, range(8))
    assert len(rests) == 3 and max(gaps) - min(gaps) <= 1

"""The streamer's execution order answers "the next streamed units after this one" as a walk along
the order would: in execution order, skipping kept units, wrapping into the next forward, never
the asking unit itself."""

import random

from diffusers_offload.offload_core.transport.order import ExecutionOrder


def _walk(order: list[int], streamed: set[int], index: int, count: int, next_forward: int | None = None) -> list[int]:
    """The definition: step along the order from ``index`` (from the start when it is not in it),
    taking at most ``next_forward`` units once the walk has wrapped past the order's end."""
    pos = order.index(index) if index in order else -1
    out: list[int] = []
    wrapped = 0
    for step in range(1, len(order) + 1):
        nxt = order[(pos + step) % len(order)]
        if nxt == index or len(out) >= count:
            break
        if nxt in streamed:
            if pos + step >= len(order):
                if next_forward is not None and wrapped >= next_forward:
                    break
                wrapped += 1
            out.append(nxt)
    return out


def test_upcoming_matches_a_walk_along_the_order_for_random_orders_and_resident_sets():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 30)
        order = rng.sample(range(n + 3), n)  # not every index runs; not in index order
        streamed = {u for u in range(n + 3) if rng.random() < rng.choice((0.1, 0.5, 0.9))}
        eo = ExecutionOrder(order, streamed.__contains__)
        for index in range(n + 3):
            for count in (0, 1, 2, 3, n + 5):
                for ahead in (None, 0, 1, 2):
                    assert eo.upcoming(index, count, ahead) == _walk(order, streamed, index, count, ahead), (
                        order, streamed, index, count, ahead)


def test_refresh_reads_the_new_resident_set_and_set_the_new_order():
    streamed = {1, 3}
    eo = ExecutionOrder([0, 1, 2, 3], streamed.__contains__)
    assert eo.upcoming(3, 2) == [1]
    streamed.add(2)
    assert eo.upcoming(1, 1) == [3]  # not re-read yet: the streamer refreshes on every resident change
    eo.refresh()
    assert eo.upcoming(1, 1) == [2]
    eo.set([3, 2, 1, 0])
    assert eo.upcoming(1, 3) == [3, 2] and eo.first() == 3


def test_a_forward_in_the_known_order_rebuilds_nothing_and_another_order_is_learnt(monkeypatch):
    """Learning runs twice a forward (at its end, and at the next one's first block, on the launch
    path): a forward that ran the known order leaves the index as it is; one that ran another
    order (kept units too) is learnt."""
    from diffusers_offload.offload_core.transport.order import OrderLearner

    eo = ExecutionOrder([0, 1, 2, 3], {1, 3}.__contains__)
    learner = OrderLearner(eo)
    sets = []
    real_set = eo.set
    monkeypatch.setattr(eo, "set", lambda units: sets.append(list(units)) or real_set(units))
    learner.seen = [0, 1, 2, 3]
    learner.learn()
    learner.learn()
    assert sets == [] and eo.units == [0, 1, 2, 3]
    learner.seen = [0, 3, 2, 1]
    learner.learn()
    assert sets == [[0, 3, 2, 1]] and eo.upcoming(None, 2) == [3, 1]

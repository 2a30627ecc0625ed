"""What a synchronized streaming step spends before its copies run (Wan-14B geometry, ballast cap).

Where the host waits for each step's end, the copy engine idles at the next step's start until
the first streamed block is released (bench/README.md, run 42: 2.9 ms of a 57.6 ms step at 12
GiB). This times the preload driver's work per forward, call by call (`breakdown`), and runs the
same placement side by side in one process with variants of the step's start (`variants`): the
copies queued across a forward's end, the cycle's planning skipped (what planning elsewhere
could save at most), the non-block part eager (its graphs unused, `head_graphs.py`).

    python bench/cycle_cost.py --storage fp8_e4m3fn_fast --compile --cap 12 --out $OUT
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from benchkit import open_output, output_args, pack
from benchkit.measure import Ballast, h2d_bandwidth, launch_and_step, sync, to_host
from benchkit.models import FP8_STORAGES, build_wan, store_fp8_as, wan_forward, wan_inputs

pack()
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core.transport import blocks  # noqa: E402

DRIVER = ("_forward_begins", "_check_shortage", "_apply", "_hold_casts", "_usage", "_take_idle", "_coming_workload")
PLANNER = ("begin_cycle", "end_cycle", "preview", "room_wanted", "spare")
MEMORY = ("device_free", "allocated", "allocator_retries", "peak_allocated", "reset_peak", "empty_cache")
STREAMER = ("reset_peak", "set_lookahead", "fill_ring", "set_resident", "resident_indices", "device_bytes",
            "weights_at_peak", "head_bytes")


class Clock:
    """Inclusive host time and calls per wrapped method, by name (an instance attribute shadows
    the method for this process)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj: object, names: tuple[str, ...], prefix: str) -> None:
        for name in names:
            fn = getattr(obj, name, None)
            if fn is not None:
                setattr(obj, name, self.timed(f"{prefix}.{name}", fn))

    def timed(self, key: str, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.spent[key] += time.perf_counter() - t0
                self.calls[key] += 1
        return call

    def per_forward(self, forwards: int) -> dict[str, list[float]]:
        """{name: [µs per forward, calls per forward]}, the costliest first."""
        return {k: [round(v / forwards * 1e6, 1), round(self.calls[k] / forwards, 2)]
                for k, v in sorted(self.spent.items(), key=lambda kv: -kv[1])}


def breakdown(m, feeds, streamer, forwards: int) -> dict:
    """The driver's listener per event and its calls, timed over ``forwards`` synchronized forwards."""
    clock, driver = Clock(), streamer.driver
    listeners = streamer.events._listeners  # re-bound: the stored listener is the bound method
    for name in list(listeners):
        events = listeners[name]
        listeners[name] = lambda event, source, _fn=events, _n=name, **info: clock.timed(f"{_n}:{event}", _fn)(
            event, source, **info)
    clock.wrap(driver, DRIVER, "driver")
    clock.wrap(driver.planner, PLANNER, "planner")
    clock.wrap(driver.memory, MEMORY, "memory")
    clock.wrap(streamer, STREAMER, "streamer")
    for _ in range(forwards):
        sync()
        wan_forward(m, *feeds)
        sync()
    return clock.per_forward(forwards)


def variants(m, feeds, streamer, rounds: int, steps: int) -> dict:
    """Each variant's synchronized step, interleaved: ``rounds`` times, each variant runs ``steps``
    synchronized steps and its first is dropped (it starts from the last variant's copies across
    the forward's end); then one back-to-back loop each."""
    order, driver = streamer.order, streamer.driver
    upcoming, on_event = order.upcoming, driver.on_event
    spare = [1]  # buffers left for the next forward's entry (the engine's: 1)

    def crossing(index, count, next_forward=None):
        if next_forward is not None:
            next_forward = max(0, streamer.ring.capacity - spare[0])
        return upcoming(index, count, next_forward)

    def skip_cycle(event, source, **info):
        if event == "cycle":  # the plan stands (steady state): only the cycle's bookkeeping
            driver._entering = False
            return False
        return on_event(event, source, **info)

    def use(left: int, noplan: bool, head: bool = True) -> None:
        spare[0] = left
        streamer.events._listeners["preload"] = skip_cycle if noplan else on_event
        streamer.graphs.head.enabled = head  # (its graphs kept: off, the non-block part runs eagerly)

    order.upcoming = crossing
    names = {"engine": (1, False), "spare2": (2, False), "nocross": (streamer.ring.capacity, False),
             "noplan": (1, True), "nohead": (1, False, False)}
    steps_ms: dict[str, list[float]] = {n: [] for n in names}
    try:
        for _ in range(rounds):
            for name, variant in names.items():
                use(*variant)
                for k in range(steps):
                    sync()
                    t0 = time.perf_counter()
                    wan_forward(m, *feeds)
                    sync()
                    if k:
                        steps_ms[name].append((time.perf_counter() - t0) * 1e3)
        loops = {}
        for name, variant in names.items():
            use(*variant)
            loops[name] = launch_and_step(lambda: wan_forward(m, *feeds), repeats=12, warmup=2)[2] * 1e3
    finally:
        use(1, False)
        order.upcoming = upcoming
    return {n: {"step_ms": round(statistics.median(v), 2), "q1_q3": [round(q, 2) for q in statistics.quantiles(v, n=4)[::2]],
                "loop_ms": round(loops[n], 2), "n": len(v)} for n, v in steps_ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--storage", default="fp8_e4m3fn_fast", choices=["bf16", *FP8_STORAGES])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--cap", type=float, default=12.0)
    ap.add_argument("--workload", default="small")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pack-below", type=int, default=blocks.PACK_BELOW,
                    help="a pinned unit's tensors under this many bytes copied as one packet (0: each alone)")
    output_args(ap)
    args = ap.parse_args()
    blocks.PACK_BELOW = args.pack_below
    row = open_output(args, "cycle_cost", lines=True)
    m = build_wan(40)
    feeds = wan_inputs(args.workload, 21)
    if args.storage != "bf16":
        store_fp8_as(m, args.storage)
    to_host(m)
    h2d = h2d_bandwidth()  # before the ballast: its 1 GiB buffer would not fit beside the placement
    ballast = Ballast(args.cap)
    eng, bag = Engine(), Components(transformer=m)
    try:
        eng.place(bag, OffloadConfig(compile_blocks=args.compile))
        streamer = eng.states(bag)["transformer"].transport
        for _ in range(args.warmup):
            wan_forward(m, *feeds)
        sync()
        copied = streamer.prefetch.copied
        wan_forward(m, *feeds)
        moved = streamer.prefetch.copied - copied
        row(section="plan", plan=streamer.details()["plan"], buffers=streamer.ring.capacity, moved_gib=moved / 2**30,
            h2d_gbs=h2d / 1e9, copy_bound_ms=moved / h2d * 1e3)
        row(section="variants", cap_gib=args.cap, storage=args.storage, compile=args.compile, pack_below=args.pack_below,
            **variants(m, feeds, streamer, args.rounds, args.steps))
        row(section="breakdown", us_per_forward=breakdown(m, feeds, streamer, forwards=20))
    finally:
        eng.release(bag)
        ballast.close()
    row.save()


if __name__ == "__main__":
    main()

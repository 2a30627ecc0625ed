"""Does `graph_worth`'s verdict match what CUDA graphs gain? (offload_core/transport/graph_worth.py)

Per model (its transformer with every block kept, fp8 storage unless ``model:storage`` says
otherwise), three placements in one process: as shipped (graph_worth times the second forward;
its clocks and verdict are read from its log line), graphs forced on (graph_worth unsubscribed)
and graphs off. Each row: the synchronized step, the host's launch time, the back-to-back loop,
the graphs made. The gain is the eager step over the graphed one; the verdict should set graphs
aside where it is about 1. With ``--clocks N`` each placement's first N forwards are also timed
one by one, back to back as a pipeline runs them, with the places where the host waited for the
device (torch's sync debug mode): was the timed second forward slower for one-time costs or for
waiting on the first? With ``--cap GiB`` each placement runs with preload auto on a card of that
size (a ballast process holds the rest): the verdict on a streamed plan. With ``--blocks`` one more
synchronized forward per placement stamps each block's entry on the host and on the device: where,
within a forward, the host's launches stop running ahead of the device.

    python3 bench/graph_verdict_probe.py --models wan:fp8_e4m3fn_fast,wan,zimage,flux,klein9b,qwenimage --out $OUT
    .venv/bin/python bench/graph_verdict_probe.py --tiny --models wan,zimage    # CPU: the flow only
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from benchkit import open_output, output_args, pack
from benchkit.image_models import IMAGE_MODELS
from benchkit.measure import Ballast, launch_and_step, python_speed_ms
from benchkit.models import build_wan, store_fp8_as, wan_forward, wan_inputs

pack()
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core.transport.graph_worth import GraphWorth  # noqa: E402

WAYS = ("shipped", "graphs", "eager")


class VerdictLines(logging.Handler):
    """The (host s, device s) of graph_worth's verdict lines, in order."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.clocks: list[tuple[float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "eager forward launched" in record.msg:
            self.clocks.append((float(record.args[1]), float(record.args[2])))


def build(name: str, dev: str, tiny: bool):
    """The model, its inputs and its forward; ``name`` is ``model[:storage]``."""
    model, _, storage = name.partition(":")
    if model == "wan":
        m, feed, forward = build_wan(2 if tiny else 40, dev, tiny), wan_inputs("small", 21, dev), wan_forward
    else:
        image = IMAGE_MODELS[model]
        m, feed, forward = image.build(dev, tiny), image.inputs("image", dev, tiny), image.forward
    storage = storage or "fp8_e4m3fn"
    if storage != "bf16":
        store_fp8_as(m, storage)
    return m, feed, forward, storage


def place(m, way: str, dev: str, preload: str) -> tuple[Engine, Components]:
    extra = dict(device="cpu", on_demand_threshold_gb=0, resident_floor_mb=0) if dev == "cpu" else {}
    eng, bag = Engine(), Components(transformer=m)
    eng.place(bag, OffloadConfig(preload=preload, cuda_graphs=way != "eager", **extra))
    if way == "graphs":
        eng.states(bag)["transformer"].transport.events.unsubscribe(GraphWorth.NAME)
    return eng, bag


def first_forwards(fn, n: int, cuda: bool) -> tuple[list[float], list[dict[str, int]]]:
    """The host seconds of each of the first ``n`` calls of ``fn``, none synchronized, and per call
    where it made the host wait for the device (file:line of torch's sync warnings)."""
    clocks, waits = [], []
    for _ in range(n):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            began = time.perf_counter()
            try:
                fn()
            finally:
                clocks.append(time.perf_counter() - began)
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
        waits.append(dict(Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                  if "synchroniz" in str(w.message))))
    return clocks, waits


ALLOCATOR = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def block_clocks(fn, blocks: list[torch.nn.Module]) -> tuple[list[float], list[float], dict[str, int]]:
    """One synchronized call of ``fn``: per block entered (and its return), the host's and the
    device's milliseconds since the call began; and the allocator's counts in it that make the
    host wait (a retry frees cached memory: a device-wide synchronize)."""
    stamps: list[tuple[float, torch.cuda.Event]] = []

    def stamp(*_):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        stamps.append((time.perf_counter(), event))

    hooks = [b.register_forward_pre_hook(stamp) for b in blocks]
    try:
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        stamp()
        fn()
        stamp()
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
    finally:
        for hook in hooks:
            hook.remove()
    t0, e0 = stamps[0]
    return ([round((t - t0) * 1000, 2) for t, _ in stamps[1:]],
            [round(e0.elapsed_time(e), 2) for _, e in stamps[1:]],
            {k: after.get(k, 0) - before.get(k, 0) for k in ALLOCATOR})


def probe(name: str, args, row, lines: VerdictLines) -> None:
    dev = "cpu" if args.tiny else "cuda"
    m, feed, forward, storage = build(name, dev, args.tiny)
    if args.cap and dev == "cuda":
        m.to("cpu")  # placed from the host, as a pipeline's model is: the ballast leaves the card ``cap`` GiB
        torch.cuda.empty_cache()
    for way in args.ways.split(","):
        heard = len(lines.clocks)
        ballast = Ballast(args.cap) if args.cap and dev == "cuda" else None
        eng, bag = place(m, way, dev, "auto" if args.cap else "1000")
        try:
            if args.clocks:
                clocks, waits = first_forwards(lambda: forward(m, *feed), args.clocks, dev == "cuda")
                row(section="forwards", model=name.partition(":")[0], way=way, host_s=clocks, waits=waits)
            launch, step, loop = launch_and_step(lambda: forward(m, *feed), args.repeats,
                                                 max(0, args.warmup - args.clocks))
            streamer = eng.states(bag)["transformer"].transport
            if args.blocks and dev == "cuda":
                blocks = list(dict.fromkeys(u.block.module for u in streamer.units))
                host_ms, device_ms, allocator = block_clocks(lambda: forward(m, *feed), blocks)
                row(section="blocks", model=name.partition(":")[0], way=way, host_ms=host_ms, device_ms=device_ms,
                    **allocator)
            worth = getattr(streamer, "worth", None)
            verdict = lines.clocks[heard] if len(lines.clocks) > heard else None
            row(section="way", model=name.partition(":")[0], storage=storage, way=way, cap=args.cap, launch_s=launch, step_s=step, loop_s=loop,
                graphs=streamer.details().get("graphs"), aside=worth.aside() if worth and way == "shipped" else None,
                verdict_host_s=verdict and verdict[0], verdict_device_s=verdict and verdict[1],
                python_ms=round(python_speed_ms(), 1))
        finally:
            eng.release(bag)
            if ballast is not None:
                ballast.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="wan:fp8_e4m3fn_fast,wan,zimage,flux,klein9b,qwenimage",
                    help="comma list of model[:storage] (wan or " + ", ".join(IMAGE_MODELS) + "; fp8_e4m3fn by default)")
    ap.add_argument("--warmup", type=int, default=6, help="forwards before timing: the plan settles, graphs are made")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clocks", type=int, default=0, help="time the first N forwards one by one (part of the warm-up)")
    ap.add_argument("--cap", type=float, default=0.0, help="GiB of card for each placement, preload auto (0: every block kept)")
    ap.add_argument("--ways", default=",".join(WAYS), help="comma list of: " + ", ".join(WAYS))
    ap.add_argument("--blocks", action="store_true", help="stamp each block's entry in one synchronized forward")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU: the flow only (no graphs there)")
    output_args(ap)
    args = ap.parse_args()
    row = open_output(args, "graph_verdict_probe", lines=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    lines = VerdictLines()
    logging.getLogger("diffusers_offload.graphs").addHandler(lines)
    for name in args.models.split(","):
        probe(name.strip(), args, row, lines)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the model is gone with the probe's frame


if __name__ == "__main__":
    main()

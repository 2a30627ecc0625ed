"""The streamer's CUDA graphs (offload_core/transport/graphs.py: kept blocks, streamed units): the
same engine rows with graphs off and on, alternated twice in one process (the host's speed drifts
within a process: run 28), outputs compared bit for bit against the eager engine's.

Wan-14B geometry, image-like workload (the host-launch-bound step), at each ballast cap (0: every
block kept, no ballast). Per row: the synchronized step, the host's launch time, the back-to-back
loop, the pure-Python probe right after, the graphs made and refused and their device bytes, and
the bound (max(resident step, bytes copied per timed step / pinned H2D); for fp8, the last every-block-kept row
(cap 0) with the same graphs setting stands for resident: the same cast path, so run cap 0 first). ``--video-cap`` adds the video workload at
that cap (two timed forwards), where graphs must stay off (inputs above the limit).

    python3 bench/graph_bench.py --caps 0,24,12 --out $OUT               # ~3 min on the H200
    python3 bench/graph_bench.py --storage fp8_e4m3fn --caps 0,24,12 --out $OUT
    .venv/bin/python bench/graph_bench.py --tiny                          # CPU: flow only (no graphs there)
"""

from __future__ import annotations

import argparse
import logging

import torch
from benchkit import open_output, output_args, pack
from benchkit.measure import (
    Ballast,
    SyncLoads,
    alloc_counts,
    h2d_bandwidth,
    launch_and_step,
    python_speed_ms,
    timed,
)
from benchkit.models import build_wan, wan_forward, wan_inputs
from benchkit.table import bound_s

pack()
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core.formats.fp8 import store_fp8  # noqa: E402

GiB = 2**30
FP8 = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def config(dev: str, cap: float, graphs: bool, tiny_budget: float) -> OffloadConfig:
    preload = "1000" if not cap else ("auto" if dev == "cuda" else tiny_budget)
    extra = dict(device="cpu", on_demand_threshold_gb=0, resident_floor_mb=0) if dev == "cpu" else {}
    return OffloadConfig(preload=preload, cuda_graphs=graphs, **extra)


def engine_row(m, feed, cfg: OffloadConfig, args, cap: float, repeats: int) -> tuple[dict, torch.Tensor]:
    """One placement's row (not recorded yet) and its last output."""
    eng, bag = Engine(), Components(transformer=m)
    eng.place(bag, cfg)
    try:
        streamer = eng.states(bag)["transformer"].transport
        loads = SyncLoads(streamer)
        med, runs, out = timed(lambda: wan_forward(m, *feed), args.warmup, repeats, after=loads.mark)
        retries = alloc_counts()[1]
        launch, step, loop = launch_and_step(lambda: wan_forward(m, *feed), repeats)
        d = streamer.details()
        fields = dict(section="engine", cap_gib=cap, graphs_on=cfg.cuda_graphs, median_s=med, runs=runs,
                      launch_s=launch, step_s=step, loop_s=loop, python_ms=round(python_speed_ms(), 1),
                      graphs=d["graphs"], graphs_refused=d["graphs_refused"], graph_mib=d["graph_bytes"] / 2**20,
                      kept=d["kept"], kept_gib=streamer.kept_bytes() / GiB,
                      streamed_gib=streamer.streamed_bytes() / GiB, moved_gib=loads.moved_gib(args.warmup, repeats),
                      sync_loads=d["sync_loads"], ooms=d["ooms"],
                      alloc_retries=retries, retries_in_timing=alloc_counts()[1] - retries)
        return fields, out
    finally:
        eng.release(bag)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", default="0,24,12")
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--storage", choices=("bf16", *FP8), default="bf16")
    ap.add_argument("--warmup", type=int, default=3, help="forwards before timing (a graph is made at the second)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs per cap")
    ap.add_argument("--video-cap", type=float, default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: 2 blocks of width 128")
    output_args(ap)
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    row = open_output(args, f"graph_bench_{args.storage}", lines=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    m = build_wan(2 if args.tiny else args.blocks, device=dev, tiny=args.tiny)
    if args.storage != "bf16":
        store_fp8(m, FP8[args.storage], torch.bfloat16)
    feed = wan_inputs("small", 1, device=dev)
    h2d = h2d_bandwidth() if dev == "cuda" else None
    row(section="env", gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
        h2d_gbs=h2d / 1e9 if h2d else None, storage=args.storage, python_ms=round(python_speed_ms(), 1))
    resident_s: dict[bool, float] = {}
    ref = None
    if args.storage == "bf16":
        resident_s[False], _runs, ref = timed(lambda: wan_forward(m, *feed), args.warmup, args.repeats)
        launch, step, loop = launch_and_step(lambda: wan_forward(m, *feed), args.repeats)
        resident_s[True] = resident_s[False]
        row(section="resident", median_s=resident_s[False], launch_s=launch, step_s=step, loop_s=loop,
            python_ms=round(python_speed_ms(), 1))
    m.to("cpu")
    tiny_budget = max(sum(t.nbytes for t in b.parameters()) for b in m.blocks) * 1.5 / GiB
    for cap in [float(c) for c in args.caps.split(",")]:
        hold = Ballast(cap if dev == "cuda" else None)
        try:
            for _ in range(args.rounds):
                for graphs in (False, True):
                    r, out = engine_row(m, feed, config(dev, cap, graphs, tiny_budget), args, cap, args.repeats)
                    ref = out if ref is None else ref  # fp8: the first eager engine row's output
                    if args.storage != "bf16" and not cap:
                        resident_s[graphs] = r["median_s"]
                    reference = resident_s.get(graphs, 0.0)
                    bound = bound_s(r, reference, 0.0, h2d) if reference else None
                    row(**r, bit_equal=bool(torch.equal(out, ref)), over_bound=r["median_s"] / bound if bound else None)
            if cap == args.video_cap:
                video = wan_inputs("video", 2 if args.tiny else 21, device=dev)
                for graphs in (False, True):
                    r, _out = engine_row(m, video, config(dev, cap, graphs, tiny_budget), args, cap, 2)
                    row(**r, workload="video")
        finally:
            hold.close()
    row.save()


if __name__ == "__main__":
    main()

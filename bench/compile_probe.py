"""How much faster the Wan-14B blocks compute under ``torch.compile`` (diffusers'
``compile_repeated_blocks``) than eager, resident in bf16 on one GPU: the image-like and video
steps, median of synchronized steps, per block, and the compiled output's error against eager.

    python bench/compile_probe.py --blocks 8 --workloads small,video

A probe, not a row: it says whether a compiled compute path is worth building (bench/README).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from benchkit import models
from benchkit.measure import rel_err, sync


def step_time(m, inputs, warmup: int, runs: int) -> tuple[float, torch.Tensor]:
    for _ in range(warmup):
        out = models.wan_forward(m, *inputs)
    times = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        out = models.wan_forward(m, *inputs)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--workloads", default="small,video")
    p.add_argument("--modes", default="default", help="torch.compile modes to try, comma-separated")
    args = p.parse_args()
    m = models.build_wan(args.blocks)
    for name in args.workloads.split(","):
        inputs = models.wan_inputs(name, 21)
        runs = 10 if name == "small" else 3
        eager, ref = step_time(m, inputs, 3, runs)
        print(f"{name}: eager {eager:.4f} s ({eager / args.blocks * 1e3:.2f} ms a block)", flush=True)
        for mode in args.modes.split(","):
            c = models.build_wan(args.blocks)
            t0 = time.perf_counter()
            c.compile_repeated_blocks(fullgraph=True, mode=None if mode == "default" else mode)
            step_time(c, inputs, 0, 1)  # the compile
            took = time.perf_counter() - t0
            t, out = step_time(c, inputs, 3, runs)
            print(f"{name}: compiled ({mode}) {t:.4f} s ({t / args.blocks * 1e3:.2f} ms a block) = "
                  f"{t / eager:.3f} x eager; first call {took:.1f} s; rel_err {rel_err(out, ref):.2e}", flush=True)
            del c
            torch._dynamo.reset()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""How much faster the Wan-14B blocks compute under ``torch.compile`` (diffusers'
``compile_repeated_blocks``) than eager, resident in bf16 on one GPU: the image-like and video
steps, median of synchronized steps, per block, the compiled output's error against eager, and
each step's peak memory over what was allocated before it. ``--storage fp8_e4m3fn``: the blocks'
Linear weights stored in fp8 and dequantised inside each layer's forward (the engine's compiled
twins, `transport/compiled.py`), eager against compiled.

    python bench/compile_probe.py --blocks 8 --workloads small,video [--modes default,max-autotune-no-cudagraphs]

A probe, not a row: it says whether a compiled compute path is worth building (bench/README).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from benchkit import models, pack
from benchkit.measure import rel_err, sync


def step_time(m, inputs, warmup: int, runs: int) -> tuple[float, torch.Tensor, float]:
    """(median step s, output, peak GiB allocated during the steps over what was there before)."""
    for _ in range(warmup):
        out = models.wan_forward(m, *inputs)
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        out = models.wan_forward(m, *inputs)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out, (torch.cuda.max_memory_allocated() - base) / 2**30


def build(blocks: int, storage: str) -> torch.nn.Module:
    """The Wan-14B geometry; in fp8, each block replaced by its dequantising twin."""
    m = models.build_wan(blocks)
    if storage == "bf16":
        return m
    from diffusers_offload.offload_core.formats.fp8 import table_of  # after `benchkit.pack()`
    from diffusers_offload.offload_core.transport.compiled import twin

    models.store_fp8_as(m, storage)
    table = table_of(m)
    for i, block in enumerate(m.blocks):
        m.blocks[i] = twin(block, table, torch.device("cuda"))
    return m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--workloads", default="small,video")
    p.add_argument("--modes", default="default", help="torch.compile modes to try, comma-separated")
    p.add_argument("--storage", default="bf16", choices=["bf16", "fp8_e4m3fn"])
    args = p.parse_args()
    pack()
    m = build(args.blocks, args.storage)
    for name in args.workloads.split(","):
        inputs = models.wan_inputs(name, 21)
        runs = 10 if name == "small" else 3
        eager, ref, peak = step_time(m, inputs, 3, runs)
        print(f"{name} {args.storage}: eager {eager:.4f} s ({eager / args.blocks * 1e3:.2f} ms a block); "
              f"peak +{peak:.3f} GiB", flush=True)
        for mode in args.modes.split(","):
            c = build(args.blocks, args.storage)
            t0 = time.perf_counter()
            c.compile_repeated_blocks(fullgraph=True, mode=None if mode == "default" else mode)
            step_time(c, inputs, 0, 1)  # the compile
            took = time.perf_counter() - t0
            t, out, peak = step_time(c, inputs, 3, runs)
            print(f"{name} {args.storage}: compiled ({mode}) {t:.4f} s ({t / args.blocks * 1e3:.2f} ms a block) = "
                  f"{t / eager:.3f} x eager; first call {took:.1f} s; rel_err {rel_err(out, ref):.2e}; "
                  f"peak +{peak:.3f} GiB", flush=True)
            del c
            torch._dynamo.reset()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

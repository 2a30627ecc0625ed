"""Does torch let a capture share a graph pool whose last graph was reset? One process per
allocator backend (chosen before CUDA starts): capture into a pool, reset the graph, capture into
the same pool again; then whether a 1 GiB tensor freed afterwards goes back to the driver. The
cause behind run 69's Qwen-Image second prompt (`GraphCache._forget_unused_pool`).

    python3 bench/graph_pool_probe.py            # both backends, one line each
"""

from __future__ import annotations

import os
import subprocess
import sys

GIB = 1 << 30


def probe() -> str:
    import torch

    x = torch.randn(1 << 20, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    outcome = []
    for attempt in ("first capture", "capture after the reset"):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool)
                y = x * 2
                graph.capture_end()
            graph.replay()
            outcome.append(f"{attempt}: ok ({bool(torch.equal(y, x * 2))})")
        except Exception as exc:  # the probe reports what torch raised
            outcome.append(f"{attempt}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        graph.reset()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    hog = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    del hog
    torch.cuda.empty_cache()
    back = (torch.cuda.mem_get_info()[0] - free + GIB) / GIB
    return f"{torch.cuda.get_allocator_backend()}: " + "; ".join(outcome) + f"; a freed 1 GiB came back: {back:.2f} GiB"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(probe(), flush=True)
    else:
        for conf in ("", "backend:cudaMallocAsync"):
            env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
            subprocess.run([sys.executable, __file__, "--one"], env=env, check=False)

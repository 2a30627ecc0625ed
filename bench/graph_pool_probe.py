"""Does torch let a capture share a graph pool whose last graph was reset, and what does a refused
capture leave behind? One process per allocator backend (chosen before CUDA starts): capture into
a pool, reset the graph, capture into the same pool again; whether a 1 GiB tensor made before that
and freed after it goes back to the driver, and one made and freed after it; the same after ending
the device allocator's routing to that pool; and whether a capture into a new pool runs. The
cause behind run 69's Qwen-Image second prompt (`GraphCache._forget_unused_pool`,
`graph_memory.record`).

    python3 bench/graph_pool_probe.py            # both backends, one line each
"""

from __future__ import annotations

import os
import subprocess
import sys

GIB = 1 << 30


def _capture(torch, pool, x, stream) -> str:
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            y = x * 2
            graph.capture_end()
        graph.replay()
        torch.cuda.synchronize()
        said = f"ok, replay {'equal' if torch.equal(y, x * 2) else 'differs'}"
    except Exception as exc:  # the probe reports what torch raised
        said = f"{type(exc).__name__}: {str(exc).splitlines()[0][:110]}"
    graph.reset()
    return said


def _freed_comes_back(torch) -> str:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    hog = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    del hog
    torch.cuda.empty_cache()
    return f"{(torch.cuda.mem_get_info()[0] - free + GIB) / GIB:.2f} GiB of a freed 1 GiB came back"


def probe() -> str:
    import torch

    x, stream, pool = torch.randn(1 << 20, device="cuda"), torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    said = [f"first capture: {_capture(torch, pool, x, stream)}"]
    made_before = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    said.append(f"again into its pool after the reset: {_capture(torch, pool, x, stream)}")
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    del made_before
    torch.cuda.empty_cache()
    said.append(f"{(torch.cuda.mem_get_info()[0] - free) / GIB:.2f} GiB of 1 GiB made before it and freed after came back")
    said.append(_freed_comes_back(torch))
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
        said.append("routing to the pool ended")
    except Exception as exc:  # nothing was routed there
        said.append(f"ending the routing: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
    said += [_freed_comes_back(torch), f"into a new pool: {_capture(torch, torch.cuda.graph_pool_handle(), x, stream)}"]
    return f"{torch.cuda.get_allocator_backend()}: " + "; ".join(said)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(probe(), flush=True)
    else:
        for conf in ("", "backend:cudaMallocAsync"):
            env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
            subprocess.run([sys.executable, __file__, "--one"], env=env, check=False)

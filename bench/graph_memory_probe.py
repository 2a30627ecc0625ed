"""Under cudaMallocAsync: how much driver memory a CUDA graph's launch needs, whether the driver's
trim gives back an idle graph's memory, and whether emptying the allocator's cache makes room
for a launch. One graph whose call has a 1 GiB intermediate; the card filled to a margin below
each launch. Run with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (bench/README.md, run 62)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload_core.transport import graph_memory  # noqa: E402

GIB = 1 << 30
DEV = torch.device("cuda")


def wide(x: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(0).expand(32, *x.shape) * 2).sum(0)


def attrs() -> dict[str, float]:
    return {"graph_reserved_gib": graph_memory.reserved(DEV) / GIB,
            "free_gib": torch.cuda.mem_get_info(DEV)[0] / GIB,
            "pool_reserved_gib": torch.cuda.memory_reserved(DEV) / GIB}


def say(what: str, **more) -> None:
    print(json.dumps({"step": what, **attrs(), **more}), flush=True)


def launched(g: torch.cuda.CUDAGraph, what: str, row: dict) -> bool:
    try:
        g.replay()
        torch.cuda.synchronize()
    except RuntimeError as exc:
        say(f"{what} failed", error=str(exc).splitlines()[0][:80], **row)
        return False
    say(f"{what} ok", **row)
    return True


@torch.no_grad()
def main() -> None:
    say("start", backend=torch.cuda.get_allocator_backend())
    x = torch.randn(8 << 20, device=DEV)
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        g.capture_begin(capture_error_mode="thread_local")
        out.copy_(wide(x))
        g.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    say("captured")
    g.replay()
    torch.cuda.synchronize()
    say("first launch")
    graph_memory.trim(DEV)
    say("trimmed, graph alive")
    for margin in (0.5, 1.0, 1.25, 1.5, 2.0, 3.0):
        for cached in (False, True):
            torch.cuda.empty_cache()
            graph_memory.trim(DEV)
            if cached:
                wide(x)
            torch.cuda.synchronize()
            free = torch.cuda.mem_get_info(DEV)[0]
            hog = torch.empty(free - int(margin * GIB), dtype=torch.uint8, device=DEV)
            row = {"margin_gib": margin, "eager_cached": cached}
            if not launched(g, "launch", row):
                torch.cuda.empty_cache()
                graph_memory.trim(DEV)
                launched(g, "retry", row)
            del hog
    g.reset()
    graph_memory.trim(DEV)
    say("graph reset, trimmed")


if __name__ == "__main__":
    main()

"""Under cudaMallocAsync: how much driver memory a CUDA graph's launch needs, whether the driver's
trim gives back an idle graph's memory, and whether emptying the allocator's cache makes room
for a launch. One graph whose call has a 1 GiB intermediate; the card filled to a margin below
each launch (run 62). ``--part sharing``: three graphs (two with one 1 GiB intermediate, one with
two in turn): what `graph_memory.footprint` reads from each template against what its first launch
maps, and whether graphs launched in turn on one stream share the driver's memory (run 63).
``--part reuse``: whether a first launch on a full card takes the driver's idle graph memory. Run
with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload_core.transport import graph_memory  # noqa: E402

GIB = 1 << 30
DEV = torch.device("cuda")


def wide(x: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(0).expand(32, *x.shape) * 2).sum(0)


def attrs() -> dict[str, float]:
    return {"graph_reserved_gib": graph_memory.reserved(DEV) / GIB, "graph_used_gib": graph_memory.used(DEV) / GIB,
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


def twice(x: torch.Tensor) -> torch.Tensor:
    return wide(wide(x) + 1)  # two 1 GiB intermediates, one after the other


def other(x: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(0).expand(32, *x.shape) + 3).amax(0)


def captured(fn, x: torch.Tensor, out: torch.Tensor, side: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, dict]:
    g = plain_capture(fn, x, out, side, keep=True)
    t0 = time.perf_counter()
    need = graph_memory.footprint(g)
    read_us = (time.perf_counter() - t0) * 1e6
    g.instantiate()
    return g, {"footprint_gib": need / GIB, "footprint_read_us": round(read_us, 1)}


@torch.no_grad()
def margins() -> None:
    say("start", backend=torch.cuda.get_allocator_backend())
    x = torch.randn(8 << 20, device=DEV)
    out = torch.empty_like(x)
    g, row = captured(wide, x, out, torch.cuda.Stream())
    need = graph_memory.footprint(g)
    say("captured", **row)
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
            row = {"margin_gib": margin, "eager_cached": cached, "fits": graph_memory.fits(DEV, need)}
            if not launched(g, "launch", row):
                torch.cuda.empty_cache()
                graph_memory.trim(DEV)
                launched(g, "retry", row)
            del hog
    g.reset()
    graph_memory.trim(DEV)
    say("graph reset, trimmed")


@torch.no_grad()
def sharing() -> None:
    say("start", backend=torch.cuda.get_allocator_backend())
    x = torch.randn(8 << 20, device=DEV)
    outs = {name: torch.empty_like(x) for name in ("wide", "other", "twice")}
    side = torch.cuda.Stream()
    graphs = {}
    for name, fn in (("wide", wide), ("other", other), ("twice", twice)):
        graphs[name], row = captured(fn, x, outs[name], side)
        say(f"captured {name}", **row)
    for name in ("wide", "other", "twice", "wide", "other"):
        before, fits = graph_memory.reserved(DEV), graph_memory.fits(DEV, graph_memory.footprint(graphs[name]))
        graphs[name].replay()
        torch.cuda.synchronize()
        say(f"launched {name}", took_gib=(graph_memory.reserved(DEV) - before) / GIB, fits=fits,
            equal=bool(torch.equal(outs[name], {"wide": wide, "other": other, "twice": twice}[name](x))))
    graph_memory.trim(DEV)
    say("trimmed, graphs alive")
    for g in graphs.values():
        g.reset()
    graph_memory.trim(DEV)
    say("graphs reset, trimmed")


@torch.no_grad()
def discard() -> None:
    """A graph captured and reset before its first launch, then the call captured again and launched:
    with and without keep_graph, with and without a card-sized tensor freed in between."""
    x = torch.randn(8 << 20, device=DEV)
    side = torch.cuda.Stream()
    for keep in (False, True):
        for hog in (False, True):
            out = torch.empty_like(x)
            row = {"keep_graph": keep, "hog_freed_between": hog}
            try:
                g = plain_capture(wide, x, out, side, keep)
                g.reset()
                if hog:
                    torch.cuda.empty_cache()
                    big = torch.empty(torch.cuda.mem_get_info(DEV)[0] - GIB // 2, dtype=torch.uint8, device=DEV)
                    del big
                g = plain_capture(wide, x, out, side, keep)
                g.replay()
                torch.cuda.synchronize()
                say("recaptured and launched", equal=bool(torch.equal(out, wide(x))), **row)
                g.reset()
                torch.randn(4, device=DEV)  # the generator left out of capture mode
                say("random numbers after", **row)
            except Exception as exc:  # noqa: BLE001 - the probe reports what failed
                say("failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}", **row)


@torch.no_grad()
def reuse() -> None:
    """Whether a first launch maps the driver's idle graph memory (reserved, not used) rather than
    free memory: graph A launched, the card filled to half a GiB free, then graph B's first launch
    (each with a 1 GiB intermediate), after a synchronize and right behind A. Run 66: B took no more,
    either way; FLUX.2's graphs did not share so (`graph_memory.fits` counts free memory only)."""
    say("start", backend=torch.cuda.get_allocator_backend())
    x = torch.randn(8 << 20, device=DEV)
    side = torch.cuda.Stream()
    ref = wide(x)  # before the card is filled: the eager check needs 1 GiB
    for synced in (True, False):
        outs = [torch.empty_like(x), torch.empty_like(x)]
        a, b = (captured(wide, x, out, side)[0] for out in outs)
        a.replay()
        if synced:
            torch.cuda.synchronize()
        idle = graph_memory.reserved(DEV) - graph_memory.used(DEV)
        torch.cuda.empty_cache()
        hog = torch.empty(torch.cuda.mem_get_info(DEV)[0] - GIB // 2, dtype=torch.uint8, device=DEV)
        row = {"synced": synced, "idle_gib": idle / GIB,
               "fits_free_only": graph_memory.fits(DEV, graph_memory.footprint(b))}
        before = graph_memory.reserved(DEV)
        ok = launched(b, "first launch of b", row)
        say("b", took_gib=(graph_memory.reserved(DEV) - before) / GIB,
            equal=ok and bool(torch.equal(outs[1], ref)), **row)
        del hog
        a.reset()
        b.reset()
        graph_memory.trim(DEV)


def plain_capture(fn, x: torch.Tensor, out: torch.Tensor, side: torch.cuda.Stream, keep: bool) -> torch.cuda.CUDAGraph:
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph(keep_graph=keep)
    with torch.cuda.stream(side):
        g.capture_begin(capture_error_mode="thread_local")
        try:
            out.copy_(fn(x))
        finally:
            g.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return g


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--part", choices=("margins", "sharing", "discard", "reuse"), default="margins")
    {"margins": margins, "sharing": sharing, "discard": discard, "reuse": reuse}[ap.parse_args().part]()

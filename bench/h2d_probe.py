"""Host-to-device speed from the model's own page-locked-in-place memory against a pinned buffer,
in this process: is a slow fresh process a slow copy source?

Why: the Wan-14B 24 GiB image-like row ran 1.01 x, 1.22 x and 1.38 x its bound in three fresh
processes with the same plan (run 26), while the bound's H2D figure comes from a buffer PyTorch
pins itself (`measure.h2d_bandwidth`). The streamer copies from the model's tensors, registered in
place (`pinning.PinSet`): their pages are the allocator's, 4 KiB or transparent huge pages as the
kernel had them, and the copy engine walks them. This times the streamer's own copies (tensor by
tensor into one device buffer, on a side stream) from the registered blocks and from the same
bytes in a pinned buffer, the host's cost of issuing one copy from each (is a slow process's extra
launch time the driver finding a registered range?), and the transparent-huge-page state.

    python3 bench/h2d_probe.py --out $OUT        # GPU, Wan-14B geometry (40 blocks), ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from benchkit import GiB, open_output, output_args, pack
from benchkit.measure import h2d_bandwidth, to_host
from benchkit.models import blocks_of, build_wan

pack()
from diffusers_offload.offload_core.pinning import PinSet  # noqa: E402


def timed_copies(sources: list[list[torch.Tensor]], head: int | None = None, repeats: int = 3) -> tuple[float, float]:
    """(median s to issue, median s until done) of copying each block's tensors, one after another,
    into one device buffer on a side stream, as the streamer does; ``head``: only each tensor's first
    ``head`` bytes (the host's per-copy cost without the link's)."""
    parts = [[t.reshape(-1)[: max(1, head // t.element_size())] if head else t for t in block] for block in sources]
    dst = torch.empty(max(sum(t.nbytes for t in block) for block in parts), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    issued, done = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for block in parts:
                at = 0
                for t in block:
                    dst[at:at + t.nbytes].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
                    at += t.nbytes
        issued.append(time.perf_counter() - t0)
        stream.synchronize()
        done.append(time.perf_counter() - t0)
    return statistics.median(issued), statistics.median(done)


def copy_rate(sources: list[list[torch.Tensor]]) -> float:
    """Bytes/s of the streamer's copies from ``sources``."""
    return sum(t.nbytes for block in sources for t in block) / timed_copies(sources)[1]


def issue_us(sources: list[list[torch.Tensor]]) -> float:
    """Host microseconds to issue one small asynchronous copy from each tensor (its first 4 KiB):
    the driver's per-copy cost (finding the source's page-locked range), not the link's."""
    return timed_copies(sources, head=4096, repeats=5)[0] / sum(len(block) for block in sources) * 1e6


def huge_pages() -> dict[str, str]:
    """The kernel's transparent-huge-page setting and this process's anonymous huge pages."""
    out = {}
    for name in ("enabled", "defrag"):
        path = Path("/sys/kernel/mm/transparent_hugepage") / name
        out[f"thp_{name}"] = path.read_text().strip() if path.exists() else "?"
    rollup = Path("/proc/self/smaps_rollup")
    for line in rollup.read_text().splitlines() if rollup.exists() else []:
        if line.startswith(("AnonHugePages", "Anonymous")):
            key, value = line.split(":", 1)
            out[key] = value.strip()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=40)
    output_args(ap)
    args = ap.parse_args()
    row = open_output(args, "h2d_probe", lines=True)
    m = build_wan(args.blocks, device="cuda")  # as wan_bench builds it: drawn on the GPU, then to host memory
    to_host(m)
    blocks = [[t.data for t in b.parameters()] for b in blocks_of(m)]
    pins = PinSet()
    registered = [[pins.pin(t) for t in block] for block in blocks]
    copies = [[t.pin_memory() for t in block] for block in blocks[:4]]  # PyTorch's own pinned buffers
    row(section="h2d", buffer_gbs=h2d_bandwidth() / 1e9, registered_gbs=copy_rate(registered) / 1e9,
        registered_first4_gbs=copy_rate(registered[:4]) / 1e9, pinned_copy_first4_gbs=copy_rate(copies) / 1e9,
        gib=sum(t.nbytes for b in blocks for t in b) / GiB, registrations=sum(len(b) for b in registered),
        registered_issue_us=issue_us(registered[:4]), pinned_copy_issue_us=issue_us(copies), **huge_pages())
    pins.release()


if __name__ == "__main__":
    main()

"""Does memory pressure change a convolution's result for the rest of the process?

Wan's patch embedding (Conv3d 16 -> 5120, kernel and stride 1x2x2, bf16) on the 480p/81-frame
video latent, once per subprocess: with the whole device free, then with a holder leaving only
``--leave`` GiB free. cuDNN's algorithm search under pressure skips the algorithms whose workspace
does not fit (each skip is an OOM that torch counts and swallows) and torch caches the algorithm it
found for that shape: the same call without pressure afterwards (``y2``) still uses it. Found while
chasing a 0.0055 relative error of the video rows (bench/RESULTS.md, run 9): the weights were intact;
a forward that had run out of memory in its non-block part had chosen another algorithm.

    python bench/cudnn_pressure.py --leave 1.0,0.7,0.5,0.4
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CODE = """
import sys, torch
leave = float(sys.argv[1])
torch.manual_seed(0)
conv = torch.nn.Conv3d(16, 5120, (1, 2, 2), stride=(1, 2, 2)).cuda().to(torch.bfloat16)
x = torch.randn(1, 16, 21, 60, 104, device="cuda", dtype=torch.bfloat16)
hold = None
if leave > 0:
    torch.cuda.empty_cache()
    hold = torch.empty(int(torch.cuda.mem_get_info()[0] - leave * 2**30), dtype=torch.uint8, device="cuda")
with torch.inference_mode():
    y = conv(x)
    ooms = torch.cuda.memory_stats().get("num_ooms", 0)
    del hold
    y2 = conv(x)
torch.save((y.cpu(), y2.cpu(), ooms), sys.argv[2])
"""


def run(leave: float, out: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    subprocess.run([sys.executable, "-c", CODE, str(leave), str(out)], check=True)
    return torch.load(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leave", default="1.0,0.7,0.5,0.4", help="GiB left free, comma-separated")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ref, _, _ = run(0.0, Path(tmp) / "ref.pt")
        print("| GiB left free | OOMs in the search | max abs diff, under pressure | same call after |")
        print("|---:|---:|---:|---:|")
        for leave in (float(v) for v in args.leave.split(",")):
            y, y2, ooms = run(leave, Path(tmp) / f"{leave}.pt")
            d1 = (y.float() - ref.float()).abs().max().item()
            d2 = (y2.float() - ref.float()).abs().max().item()
            print(f"| {leave} | {ooms} | {d1:.4g} | {d2:.4g} |", flush=True)


if __name__ == "__main__":
    main()

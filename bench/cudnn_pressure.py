"""Does memory pressure change a convolution's result for the rest of the process?

Wan's patch embedding (Conv3d 16 -> 5120, kernel and stride 1x2x2, bf16) on the 480p/81-frame
video latent, once per subprocess: with the whole device free, then with a holder leaving only
``--leave`` GiB free. cuDNN's algorithm search under pressure skips the algorithms whose workspace
does not fit (each skip is an OOM that torch counts and swallows) and torch caches the algorithm it
found for that shape: the same call without pressure afterwards (``y2``) still uses it. Found while
chasing a 0.0055 relative error of the video rows (bench/README.md): the weights were intact; a
forward that had run out of memory in its non-block part had chosen another algorithm. The holder
is a tensor of the measured process itself here (the pressure must be on its own allocator).

    python bench/cudnn_pressure.py --leave 1.0,0.7,0.5,0.4 --out $OUT
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from benchkit import open_output, output_args
from benchkit.models import WAN14B, WORKLOADS

CODE = """
import sys, torch
leave, dim, shape = float(sys.argv[1]), int(sys.argv[3]), [int(n) for n in sys.argv[4].split(",")]
torch.manual_seed(0)
conv = torch.nn.Conv3d(16, dim, (1, 2, 2), stride=(1, 2, 2)).cuda().to(torch.bfloat16)
x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
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
    dim = WAN14B["num_attention_heads"] * WAN14B["attention_head_dim"]  # 5120
    shape = ",".join(map(str, WORKLOADS["video"]))
    subprocess.run([sys.executable, "-c", CODE, str(leave), str(out), str(dim), shape], check=True)
    return torch.load(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leave", default="1.0,0.7,0.5,0.4", help="GiB left free, comma-separated")
    output_args(ap)
    args = ap.parse_args()
    row = open_output(args, "cudnn_pressure", lines=True)
    row.echo = False
    with tempfile.TemporaryDirectory() as tmp:
        ref, _, _ = run(0.0, Path(tmp) / "ref.pt")
        print("| GiB left free | OOMs in the search | max abs diff, under pressure | same call after |")
        print("|---:|---:|---:|---:|")
        for leave in (float(v) for v in args.leave.split(",")):
            y, y2, ooms = run(leave, Path(tmp) / f"{leave}.pt")
            d1 = (y.float() - ref.float()).abs().max().item()
            d2 = (y2.float() - ref.float()).abs().max().item()
            print(f"| {leave} | {ooms} | {d1:.4g} | {d2:.4g} |", flush=True)
            row(leave_gib=leave, ooms=ooms, max_abs_diff=d1, max_abs_diff_after=d2)


if __name__ == "__main__":
    main()

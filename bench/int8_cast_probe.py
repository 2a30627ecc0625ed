"""How fast a unit of int8 weights (ComfyUI's int8_tensorwise, per-row float32 scales) becomes bf16
on this GPU: torch's cast weight by weight (`fp8.dequantize_int8`, the streamer's fallback) against
the pack's Triton kernel (`fp8_kernel.launch_int8`: a program per tile of a row) at several widths, on one
Wan-14B block (its ten Linear weights, ~0.34 GB of int8), bytes read + written per second, and
whether the kernel gives torch's bits.

    python bench/int8_cast_probe.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json

import torch
from benchkit import pack
from benchkit.measure import loop_time

pack()
from diffusers_offload.offload_core.formats.fp8 import dequantize_int8  # noqa: E402
from diffusers_offload.offload_core.transport import fp8_kernel  # noqa: E402
from diffusers_offload.offload_core.transport.cast import UnitCast, compute_views  # noqa: E402

SHAPES = [(5120, 5120)] * 8 + [(13824, 5120), (5120, 13824)]  # a Wan-14B block: two attentions, the ffn
WIDTHS = [(256, 1), (512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]



def unit() -> tuple[UnitCast, torch.Tensor, torch.Tensor]:
    """A block's int8 unit as the streamer lays it out (weights 512-aligned), its region and a buffer."""
    shapes = [torch.Size(s) for s in SHAPES]
    scales = [torch.rand(s[0], 1) * 0.01 + 1e-4 for s in shapes]
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end += -(-shape.numel() // 512) * 512
    cast = UnitCast(torch.int8, torch.bfloat16, len(shapes), end, offsets, shapes, int8_scales=scales)
    region = torch.randint(-127, 128, (end,), dtype=torch.int8, device="cuda")
    return cast, region, torch.empty(end, dtype=torch.bfloat16, device="cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    cast, region, buf = unit()
    views = compute_views(buf, cast)
    scales = cast.int8_scales_on(buf.device)
    moved = sum(v.numel() for v in views) * 3  # 1 byte read, 2 written per element

    def by_torch() -> None:
        for view, o, scale in zip(views, cast.offsets, scales, strict=True):
            dequantize_int8(region[o : o + view.numel()].view(view.shape), scale, torch.bfloat16, out=view)

    t = loop_time(by_torch, args.repeats, warmup=1)
    ref = buf.clone()
    rows = {"torch": {"ms": t * 1e3, "gb_s": moved / t / 1e9}, "kernel": []}
    for block, warps in WIDTHS:
        table = fp8_kernel.int8_table(cast.offsets, cast.shapes, cast.int8_scales, buf.device, block)
        buf.zero_()
        t = loop_time(lambda b=block, w=warps, t=table: fp8_kernel.launch_int8(buf, region, t, b, w), args.repeats, warmup=1)
        rows["kernel"].append({"block": block, "warps": warps, "ms": t * 1e3, "gb_s": moved / t / 1e9,
                               "bit_equal": bool(torch.equal(buf, ref))})
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "int8_mb": round(moved / 3 / 2**20), **rows}))


if __name__ == "__main__":
    main()

"""How fast an fp8 region becomes bf16 on this GPU: torch's ``copy_`` against the pack's Triton cast
(offload_core/transport/fp8_kernel.py) and a ``torch.compile``d cast, on one Wan-14B block-sized
region (about 0.33 GB of fp8), bytes read + written per second. Checks that all give the same bits.
``--sweep`` also times the Triton cast at other program widths, unscaled and with ten scaled
weights (a Wan block's linears), which is how `fp8_kernel.BLOCK`/`WARPS` were picked. Also times
fp8 matmuls' input quantisation (torch's clamp and cast against the fused kernel, `quantise`).

    python bench/cast_probe.py [--mb 330] [--repeats 20] [--sweep]
"""

from __future__ import annotations

import argparse
import json

import torch
from benchkit import pack
from benchkit.measure import loop_time

pack()
from diffusers_offload.offload_core.transport import fp8_kernel  # noqa: E402


def sweep(src: torch.Tensor, out: torch.Tensor, ref: torch.Tensor, repeats: int) -> list[dict]:
    """The Triton cast at each (elements, warps) per program: unscaled, and with ten weights each
    with its own scale; GB/s read + written, and whether the bits match."""
    n = src.numel()
    starts = torch.arange(10, device="cuda", dtype=torch.int64) * (n // 10 // 512 * 512)
    scales = (torch.rand(10, device="cuda") + 0.5).to(torch.bfloat16).float()
    per = torch.bucketize(torch.arange(n, device="cuda"), starts, right=True) - 1
    scaled_ref = (src.to(torch.bfloat16) * scales.to(torch.bfloat16)[per])
    one = (torch.zeros(1, dtype=torch.int64, device="cuda"), torch.ones(1, device="cuda"))
    rows = []
    for block, warps in [(512, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8),
                         (8192, 16), (16384, 16)]:
        plain = loop_time(lambda b=block, w=warps: fp8_kernel.launch(out, src, *one, b, w), repeats, warmup=1)
        equal = bool(torch.equal(out, ref))
        scaled = loop_time(lambda b=block, w=warps: fp8_kernel.launch(out, src, starts, scales, b, w), repeats, warmup=1)
        rows.append({"block": block, "warps": warps, "gb_s": n * 3 / plain / 1e9, "scaled_gb_s": n * 3 / scaled / 1e9,
                     "bit_equal": equal and bool(torch.equal(out, scaled_ref))})
    return rows


def quantise_rows(repeats: int) -> list[dict]:
    """fp8 matmuls' input quantisation (`fp8_matmul.quantise`) on a Wan-14B step's activation
    shapes: torch's clamp then cast against the fused kernel, unscaled and scaled, in microseconds,
    with whether the bits match."""
    rows = []
    for tokens, width in [(1024, 5120), (1024, 13824), (32760, 5120), (32760, 13824)]:
        x = (torch.randn(tokens, width, device="cuda") * 100).to(torch.bfloat16)
        inv = torch.tensor(0.37, device="cuda").to(torch.bfloat16)
        row = {"shape": [tokens, width]}
        for name, scale in (("plain", None), ("scaled", inv)):
            torch_us = loop_time(lambda s=scale, x=x: (x if s is None else x * s).clamp(-448, 448).to(torch.float8_e4m3fn),
                             repeats, warmup=1) * 1e6
            fused_us = loop_time(lambda s=scale, x=x: fp8_kernel.quantized(x, s), repeats, warmup=1) * 1e6
            ref = (x if scale is None else x * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            equal = bool(torch.equal(fp8_kernel.quantized(x, scale).view(torch.uint8), ref.view(torch.uint8)))
            row[name] = {"torch_us": round(torch_us, 1), "fused_us": round(fused_us, 1), "bit_equal": equal}
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=330)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    n = args.mb * 2**20
    src = torch.randn(n, device="cuda").to(torch.float8_e4m3fn)
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    moved = n * 3  # 1 byte read, 2 written per element
    compiled = torch.compile(lambda x: x.to(torch.bfloat16), dynamic=True)
    ref = src.to(torch.bfloat16)
    rows = {}
    for name, fn in {
        "copy_": lambda: out.copy_(src),
        "triton": lambda: fp8_kernel.cast_into(out, src),
        "compile": lambda: compiled(src),
    }.items():
        s = loop_time(fn, args.repeats, warmup=1)
        rows[name] = {"ms": s * 1e3, "gb_s": moved / s / 1e9}
    fp8_kernel.cast_into(out, src)
    rows["triton_bit_equal"] = bool(torch.equal(out, ref))
    half = n // 2 // 512 * 512  # two weights, each with its scale (ComfyUI's fp8_scaled formula)
    starts = torch.tensor([0, half], dtype=torch.int64, device="cuda")
    scales = torch.tensor([0.0123456789, 3.75], device="cuda").to(torch.bfloat16).float()  # as the table holds them
    fp8_kernel.cast_into(out, src, starts, scales)
    scaled_ref = torch.cat([src[:half].to(torch.bfloat16) * scales[0], src[half:].to(torch.bfloat16) * scales[1]])
    rows["triton_scaled_bit_equal"] = bool(torch.equal(out, scaled_ref))
    one = fp8_kernel.dequantized(src[:half], float(scales[0]), torch.bfloat16)  # the per-layer hook's kernel
    rows["triton_layer_bit_equal"] = bool(torch.equal(one, scaled_ref[:half]))
    rows["compile_bit_equal"] = bool(torch.equal(compiled(src), ref))
    rows["quantise"] = quantise_rows(args.repeats)
    if args.sweep:
        rows["sweep"] = sweep(src, out, ref, args.repeats, warmup=1)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "mb": args.mb, **rows}))


if __name__ == "__main__":
    main()

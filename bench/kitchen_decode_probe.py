"""How fast comfy-kitchen turns one NVFP4 or MXFP8 weight of a Wan-14B block into bf16 on this GPU
(what `NVFP4Linear` / `MXFP8Linear` run at each forward below Blackwell), against a bf16 matmul of
the layer on an image-like input (4096 tokens) and a device copy of the decoded bytes: stored
bytes read + bf16 bytes written per second, and the decode's share of the layer's time; whether the
pack's kernel (`formats/tiled_kernel.py`) gives comfy-kitchen's bits; the kernel's speed at several
tile shapes.

    python bench/kitchen_decode_probe.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from benchkit import pack
from benchkit.measure import loop_time

pack()
import comfy_kitchen as ck  # noqa: E402
from diffusers_offload.offload_core.formats import tiled_kernel  # noqa: E402

SHAPES = {"attn 5120x5120": (5120, 5120), "ffn up 13824x5120": (13824, 5120), "ffn down 5120x13824": (5120, 13824)}
TOKENS = 4096


def decoders(rows: int, cols: int) -> dict[str, tuple[Callable[[], torch.Tensor | None], int]]:
    """Each format's decode of a random ``rows`` × ``cols`` weight, and its stored bytes."""
    w = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
    scale = (w.abs().amax().float() / (6.0 * 448.0)).reshape(())
    packed, blocks = ck.quantize_nvfp4(w, scale)
    qx, e8m0 = ck.quantize_mxfp8(w)
    return {
        "nvfp4": (lambda: ck.dequantize_nvfp4(packed, scale, blocks, torch.bfloat16),
                  packed.numel() + blocks.numel() + 4),
        "nvfp4 pack": (lambda: tiled_kernel.nvfp4(packed, scale, blocks, torch.bfloat16),
                       packed.numel() + blocks.numel() + 4),
        "mxfp8": (lambda: ck.dequantize_mxfp8(qx, e8m0, torch.bfloat16), qx.numel() + e8m0.numel()),
        "mxfp8 pack": (lambda: tiled_kernel.mxfp8(qx, e8m0, torch.bfloat16), qx.numel() + e8m0.numel()),
    }


def same_bits(rows: int, cols: int) -> dict[str, bool]:
    """Whether the pack's kernel gives comfy-kitchen's bits (its CUDA kernel for NVFP4)."""
    w = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
    scale = (w.abs().amax().float() / (6.0 * 448.0) * 1.37).reshape(())  # not a power of two
    packed, blocks = ck.quantize_nvfp4(w, scale)
    kitchen = ck.dequantize_nvfp4(packed, scale, blocks, torch.bfloat16)
    qx, e8m0 = ck.quantize_mxfp8(w)
    equal = {"mxfp8": torch.equal(tiled_kernel.mxfp8(qx, e8m0, torch.bfloat16),
                                  ck.dequantize_mxfp8(qx, e8m0, torch.bfloat16))}
    equal["nvfp4"] = torch.equal(tiled_kernel.nvfp4(packed, scale, blocks, torch.bfloat16), kitchen)
    return equal


def tiles(rows: int, cols: int, repeats: int) -> list[dict]:
    """The pack's kernel over one weight at several tile shapes (rows × stored columns a program)."""
    out, kept = [], (tiled_kernel.ROWS, tiled_kernel.COLS)
    for name, (decode, stored) in decoders(rows, cols).items():
        if "pack" in name:
            for tile in ((16, 256), (8, 512), (32, 128), (4, 1024), (32, 256)):
                tiled_kernel.ROWS, tiled_kernel.COLS = tile
                s = loop_time(decode, repeats, warmup=2)
                out.append({"format": name, "tile": tile, "gb_s": (stored + rows * cols * 2) / s / 1e9})
    tiled_kernel.ROWS, tiled_kernel.COLS = kept
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    rows = []
    for shape, (out, inp) in SHAPES.items():
        x = torch.randn(TOKENS, inp, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(out, inp, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(w)
        matmul_s = loop_time(lambda x=x, w=w: torch.nn.functional.linear(x, w), args.repeats, warmup=2)
        copy_s = loop_time(lambda d=dst, w=w: d.copy_(w), args.repeats, warmup=2)
        for name, (decode, stored) in decoders(out, inp).items():
            decode_s = loop_time(decode, args.repeats, warmup=2)
            moved = stored + w.numel() * 2
            rows.append({"shape": shape, "format": name, "decode_ms": decode_s * 1e3, "gb_s": moved / decode_s / 1e9,
                         "copy_gb_s": w.numel() * 4 / copy_s / 1e9, "matmul_ms": matmul_s * 1e3,
                         "decode_share": decode_s / (decode_s + matmul_s)})
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "comfy_kitchen": getattr(ck, "__version__", "?"), "tokens": TOKENS, "rows": rows,
                      "bits_equal": same_bits(5120, 13824), "tiles": tiles(13824, 5120, args.repeats)}))


if __name__ == "__main__":
    main()

"""How fast comfy-kitchen turns one NVFP4 or MXFP8 weight of a Wan-14B block into bf16 on this GPU
(what `NVFP4Linear` / `MXFP8Linear` run at each forward below Blackwell), against a bf16 matmul of
the layer on an image-like input (4096 tokens) and a device copy of the decoded bytes: stored
bytes read + bf16 bytes written per second, and the decode's share of the layer's time; and which
float32 order of the scales gives comfy-kitchen's bits on this GPU (what a kernel of our own must do).

    python bench/kitchen_decode_probe.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json

import torch
from benchkit import pack
from benchkit.measure import loop_time

pack()
import comfy_kitchen as ck  # noqa: E402
from diffusers_offload.offload_core.formats import tiled_kernel  # noqa: E402

SHAPES = {"attn 5120x5120": (5120, 5120), "ffn up 13824x5120": (13824, 5120), "ffn down 5120x13824": (5120, 13824)}
TOKENS = 4096


def decoders(rows: int, cols: int) -> dict[str, tuple[callable, int]]:
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


def orders(rows: int, cols: int) -> dict[str, bool]:
    """Whether each float32 order of value × block scale × tensor scale, rounded once, gives the
    bits of comfy-kitchen's NVFP4 decode (its CUDA kernel here), and value × 2^e MXFP8's."""
    from comfy_kitchen.float_utils import e8m0_to_f32, from_blocked

    w = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
    scale = (w.abs().amax().float() / (6.0 * 448.0) * 1.37).reshape(())  # not a power of two
    packed, blocks = ck.quantize_nvfp4(w, scale)
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       device="cuda")
    values = lut[torch.stack([packed >> 4, packed & 15], -1).reshape(rows, cols).long()]
    b = from_blocked(blocks, rows, cols // 16).float().repeat_interleave(16, 1)
    kitchen = ck.dequantize_nvfp4(packed, scale, blocks, torch.bfloat16)
    qx, e8m0 = ck.quantize_mxfp8(w)
    e = e8m0_to_f32(from_blocked(e8m0.view(torch.uint8), rows, cols // 32)).repeat_interleave(32, 1)
    mine = {}
    for order in (0, 1):
        tiled_kernel.ORDER = order
        mine[f"pack kernel order {order}"] = torch.equal(tiled_kernel.nvfp4(packed, scale, blocks, torch.bfloat16),
                                                         kitchen)
    tiled_kernel.ORDER = 0
    return mine | {"pack mxfp8": torch.equal(tiled_kernel.mxfp8(qx, e8m0, torch.bfloat16),
                                             ck.dequantize_mxfp8(qx, e8m0, torch.bfloat16)),
            "nvfp4 (v*b)*g": torch.equal(((values * b) * scale).bfloat16(), kitchen),
            "nvfp4 v*(b*g)": torch.equal((values * (b * scale)).bfloat16(), kitchen),
            "nvfp4 bf16 eager": torch.equal((values.bfloat16() * (b.bfloat16() * scale.bfloat16())), kitchen),
            "mxfp8 v*e": torch.equal((qx.float() * e).bfloat16(), ck.dequantize_mxfp8(qx, e8m0, torch.bfloat16))}


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
                      "bit_orders": orders(5120, 13824)}))


if __name__ == "__main__":
    main()

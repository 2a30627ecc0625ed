"""How fast one GGUF weight of a Wan-14B feed-forward (13824 × 5120) becomes bf16 on this GPU:
diffusers' own dequantisation (``dequantize_gguf_tensor(w).to(bf16)``, what its ``GGUFLinear``
runs without the hub's CUDA kernels) against the pack's kernel (`transport/gguf_kernel.py`), per
quant type, on random blocks with finite fp16 fields; packed bytes read + bf16 bytes written per
second, and whether the bits match.

    python bench/gguf_dequant_probe.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json

import torch
from benchkit import pack
from benchkit.measure import loop_time

pack()
from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor  # noqa: E402
from diffusers_offload.offload_core.transport import gguf_kernel  # noqa: E402

TYPES = {"Q8_0": 8, "Q4_0": 2, "Q5_1": 7, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
HALVES = {2: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}  # fp16 fields
ROWS, COLS = 13824, 5120



def weight(qt: int) -> GGUFParameter:
    values, size = gguf_kernel.LAYOUTS[qt]
    blocks = ROWS * COLS // values
    raw = torch.randint(0, 256, (blocks, size), dtype=torch.uint8, device="cuda")
    for at in HALVES[qt]:
        raw[:, at:at + 2] = (torch.rand(blocks, 1, device="cuda") * 0.02 - 0.01).half().view(torch.uint8)
    return GGUFParameter(raw.reshape(ROWS, COLS // values * size), quant_type=qt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    rows = []
    for name, qt in TYPES.items():
        w = weight(qt)
        moved = w.numel() + ROWS * COLS * 2
        torch_s = loop_time(lambda w=w: dequantize_gguf_tensor(w).to(torch.bfloat16), args.repeats, warmup=1)
        kernel_s = loop_time(lambda w=w: gguf_kernel.dequantized(w, torch.bfloat16), args.repeats, warmup=1)
        equal = torch.equal(gguf_kernel.dequantized(w, torch.bfloat16), dequantize_gguf_tensor(w).to(torch.bfloat16))
        rows.append({"type": name, "packed_mb": round(w.numel() / 2**20), "torch_ms": torch_s * 1e3,
                     "kernel_ms": kernel_s * 1e3, "kernel_gb_s": moved / kernel_s / 1e9, "bit_equal": equal})
        del w
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [ROWS, COLS],
                      "rows": rows}))


if __name__ == "__main__":
    main()

"""The NVFP4 and MXFP8 decode kernel (`formats/tiled_kernel.py`) run on the CPU by Triton's
interpreter, in a process of its own: weights comfy-kitchen quantized, of shapes that leave parts
of a scale tile empty (rows not a multiple of 128, blocks not of 4), decoded into float32 equal
each element's ``(value × block scale) × tensor scale`` with the scales read untiled by
comfy-kitchen, and MXFP8 into bf16 equal to comfy-kitchen's own decode. A wrong tile offset, nibble
order or fp8 bit reading is off by far more than rounding. (Bits against comfy-kitchen's CUDA
decode: tests/gpu/test_block_scaled_layers.py.)"""

import pytest
from fixtures.kernels import run_interpreted

SCRIPT = """
import comfy_kitchen as ck
import torch
from comfy_kitchen.float_utils import from_blocked
from diffusers_offload.offload_core.formats import tiled_kernel

tiled_kernel.available = lambda t: True  # (the interpreter runs CPU tensors)
lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
torch.manual_seed(0)
for rows, cols in [(256, 512), (200, 96), (13, 48)]:
    w = torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02
    scale = (w.abs().amax().float() / (6 * 448) * 1.37).reshape(())
    packed, blocks = ck.quantize_nvfp4(w, scale, pad_16x=True)
    r, c = packed.shape[0], packed.shape[1] * 2
    values = lut[torch.stack([packed >> 4, packed & 15], -1).reshape(r, c).long()]
    b = from_blocked(blocks, r, c // 16).float().repeat_interleave(16, 1)
    assert torch.equal(tiled_kernel.nvfp4(packed, scale, blocks, torch.float32), (values * b) * scale), (rows, cols)
    q, e8m0 = ck.quantize_mxfp8(w, pad_32x=True)
    assert torch.equal(tiled_kernel.mxfp8(q, e8m0, torch.bfloat16), ck.dequantize_mxfp8(q, e8m0, torch.bfloat16))
print("tiled kernel ok")
"""


def test_the_tiled_decode_kernel_reads_each_blocks_scale_in_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(SCRIPT, "tiled kernel ok")

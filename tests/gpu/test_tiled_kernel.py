"""The NVFP4 and MXFP8 decode kernel (`formats/tiled_kernel.py`) on a CUDA device against
comfy-kitchen's own decode there (its CUDA kernel for NVFP4, its torch ops for MXFP8): the same
bits for weights it quantized, padded shapes included, bf16 and fp16. Run on the GPU machine
(bench/gpu_batch.sh row ``gputests``)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core.formats import tiled_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")
SHAPES = [(5120, 13824), (200, 96), (13, 48)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_gives_comfy_kitchens_bits(shape, dtype) -> None:
    import comfy_kitchen as ck

    torch.manual_seed(0)
    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02
    scale = (w.abs().amax().float() / (6 * 448) * 1.37).reshape(())  # not a power of two
    packed, blocks = ck.quantize_nvfp4(w, scale, pad_16x=True)
    assert torch.equal(tiled_kernel.nvfp4(packed, scale, blocks, dtype), ck.dequantize_nvfp4(packed, scale, blocks, dtype))
    q, e8m0 = ck.quantize_mxfp8(w, pad_32x=True)
    assert torch.equal(tiled_kernel.mxfp8(q, e8m0, dtype), ck.dequantize_mxfp8(q, e8m0, dtype))

"""The int8 cast kernel (`transport/fp8_kernel.py`) run on the CPU by Triton's interpreter, in a
process of its own (the interpreter is chosen when Triton is first imported): a unit of int8
weights with per-row and per-tensor scales, alignment gaps between them and after the last, each
element within one bf16 step of `fp8.dequantize_int8` (the interpreter truncates where a GPU
rounds to nearest, so bits are checked on the GPU: tests/gpu/test_int8_cast.py). A wrong row or
weight lookup is off by far more than a step."""

import pytest
from fixtures.kernels import run_interpreted

SCRIPT = """
import torch
from diffusers_offload.offload_core.formats.fp8 import dequantize_int8
from diffusers_offload.offload_core.transport import fp8_kernel
from diffusers_offload.offload_core.transport.cast import compute_views
from fixtures.kernels import int8_unit

torch.manual_seed(0)
shapes = [(37, 64), (50, 100), (130, 24), (3, 3)]
scales = [torch.rand(37, 1) + 0.01, torch.tensor(0.02), torch.rand(130, 1) * 4, torch.rand(3, 1)]
cast, offsets, region = int8_unit(shapes, scales)
cpu = torch.device("cpu")
for block in (32, 1024):  # several tiles a row (the last part masked), and one
    buf = torch.full((cast.nbytes,), float("nan"), dtype=torch.bfloat16)
    fp8_kernel.launch_int8(buf, region, fp8_kernel.int8_table(offsets, cast.shapes, scales, cpu, block), block)
    for view, offset, scale, shape in zip(compute_views(buf, cast), offsets, scales, cast.shapes):
        want = dequantize_int8(region[offset:offset + shape.numel()].view(shape), scale, torch.bfloat16).float()
        step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        assert bool(((view.float() - want).abs() <= step).all()), (block, shape)
print("int8 kernel ok")
"""


def test_the_int8_kernel_scales_each_row_in_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(SCRIPT, "int8 kernel ok")

"""The int8 cast kernel (`transport/fp8_kernel.py`) run on the CPU by Triton's interpreter, in a
process of its own (the interpreter is chosen when Triton is first imported): a unit of int8
weights with per-row and per-tensor scales, alignment gaps between them and after the last, each
element within one bf16 step of `fp8.dequantize_int8` (the interpreter truncates where a GPU
rounds to nearest, so bits are checked on the GPU: tests/gpu/test_int8_cast.py). A wrong row or
weight lookup is off by far more than a step."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("conftest", sys.argv[1])
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    import torch
    from diffusers_offload.offload_core.formats.fp8 import dequantize_int8
    from diffusers_offload.offload_core.transport import fp8_kernel
    from diffusers_offload.offload_core.transport.cast import UnitCast, compute_views

    torch.manual_seed(0)
    shapes = [torch.Size(s) for s in ([37, 64], [50, 100], [130, 24], [3, 3])]
    scales = [torch.rand(37, 1) + 0.01, torch.tensor(0.02), torch.rand(130, 1) * 4, torch.rand(3, 1)]
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end += -(-shape.numel() // 512) * 512
    cast = UnitCast(torch.int8, torch.bfloat16, len(shapes), end, offsets, shapes, int8_scales=scales)
    region = torch.randint(-127, 128, (end,), dtype=torch.int8)
    cpu = torch.device("cpu")
    for block in (32, 1024):  # several tiles a row (the last part masked), and one
        buf = torch.full((end,), float("nan"), dtype=torch.bfloat16)
        fp8_kernel.launch_int8(buf, region, fp8_kernel.int8_table(offsets, shapes, scales, cpu, block), block)
        for view, offset, scale, shape in zip(compute_views(buf, cast), offsets, scales, shapes):
            want = dequantize_int8(region[offset:offset + shape.numel()].view(shape), scale, torch.bfloat16).float()
            step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
            assert bool(((view.float() - want).abs() <= step).all()), (block, shape)
    print("int8 kernel ok")
""")


def test_the_int8_kernel_scales_each_row_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    conftest = Path(__file__).resolve().parents[1] / "conftest.py"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(conftest)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "int8 kernel ok" in out.stdout, out.stderr[-3000:]

"""The GGUF dequantising kernel (`transport/gguf_kernel.py`) run on the CPU by Triton's interpreter,
in a process of its own (the interpreter is chosen when Triton is first imported): for every quant
type it takes, blocks of random bytes (every code and scale bit pattern; the fp16 fields finite)
give diffusers' own dequantisation bit for bit in fp16 and float32 compute, and within one bf16
step in bf16 (the interpreter truncates to bf16 where a GPU rounds: bits are checked on the GPU,
tests/gpu/test_gguf_kernel.py). A misread byte, nibble or bit is off by far more."""

import pytest
from fixtures.kernels import run_interpreted

SCRIPT = """
import torch
from diffusers.quantizers.gguf.utils import dequantize_functions
from diffusers_offload.offload_core.transport import gguf_kernel

HALVES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2),
          14: (208,)}  # fp16 fields
torch.manual_seed(0)
for qt, (values, size) in gguf_kernel.LAYOUTS.items():
    nblocks = 37  # not a multiple of a program's blocks: the last program is masked
    raw = torch.randint(0, 256, (nblocks, size), dtype=torch.uint8)
    for at in HALVES[qt]:
        raw[:, at:at + 2] = (torch.rand(nblocks, 1) * 0.02 - 0.01).half().view(torch.uint8)
    ref = dequantize_functions[qt](raw, values, size).reshape(-1)
    assert torch.isfinite(ref).all(), qt
    for compute in (torch.float16, torch.float32, torch.bfloat16):
        out = torch.full((nblocks * values,), float("nan"), dtype=compute)
        gguf_kernel.launch(out, raw.reshape(-1), qt)
        want = ref.to(compute)
        if compute == torch.bfloat16:
            step = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(1e-30))) - 7)
            assert bool(((out.float() - want.float()).abs() <= step).all()), (qt, compute)
        else:
            assert torch.equal(out, want), (qt, compute, (out.float() - want.float()).abs().max())
print("gguf kernel ok")
"""


def test_the_gguf_kernel_gives_diffusers_dequantisation_in_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(SCRIPT, "gguf kernel ok")

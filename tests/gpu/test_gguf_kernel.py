"""The GGUF kernel (`transport/gguf_kernel.py`) on a CUDA device: each quant type's random blocks
(every code and scale bit pattern, fp16 fields finite) give the bits of diffusers' own
dequantisation cast to bf16 and fp16; and a GGUF Wan file placed streamed (CUDA graphs on) and in
mode leaf gives the bits of the same placements with the kernel off (diffusers' torch ops). Run on
the GPU machine (bench/gpu_batch.sh row ``gputests``)."""

from __future__ import annotations

import pytest
import torch
from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_functions
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.transport import gguf_kernel
from fixtures.gguf_files import load_gguf_wan, wan_gguf_fixture  # noqa: F401  (session fixture)
from fixtures.tiny_models import run_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs on a CUDA device")
HALVES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2),
          14: (208,)}  # fp16 fields
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", compile_blocks=False)


@pytest.mark.parametrize("qt", sorted(gguf_kernel.LAYOUTS))
def test_each_quant_type_dequantises_to_diffusers_bits(qt: int) -> None:
    torch.manual_seed(qt)
    values, size = gguf_kernel.LAYOUTS[qt]
    rows, per_row = 96, 5  # a weight of 96 rows, 5 blocks each
    raw = torch.randint(0, 256, (rows * per_row, size), dtype=torch.uint8)
    for at in HALVES[qt]:
        raw[:, at:at + 2] = (torch.rand(rows * per_row, 1) * 0.02 - 0.01).half().view(torch.uint8)
    raw = raw.cuda()
    weight = GGUFParameter(raw.reshape(rows, per_row * size), quant_type=qt)
    ref = dequantize_functions[qt](raw, values, size).reshape(rows, per_row * values)
    for compute in (torch.bfloat16, torch.float16):
        out = gguf_kernel.dequantized(weight, compute)
        assert out is not None and out.shape == ref.shape
        assert torch.equal(out, ref.to(compute)), (qt, compute)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_a_placed_gguf_file_gives_the_bits_of_diffusers_dequantisation(tiny_wan_dir, wan_gguf, qtype,
                                                                      monkeypatch) -> None:
    file = wan_gguf(qtype)
    outs, ran, real = {}, [], gguf_kernel.dequantized

    def counting(weight, compute):
        out = real(weight, compute)
        ran.append(out is not None)
        return out

    for kernel in (True, False):
        monkeypatch.setattr(gguf_kernel, "dequantized", counting if kernel else lambda *_args: None)
        for name, placement in {"auto": dict(mode="auto", preload="0.0005"), "leaf": dict(mode="leaf")}.items():
            pipe = load_gguf_wan(tiny_wan_dir, file)
            engine = Engine()
            engine.place(pipe, OffloadConfig(**BASE, **placement))
            try:
                outs[(name, kernel)] = [run_wan(pipe).cpu() for _ in range(2)]  # (the second replays graphs)
            finally:
                engine.release(pipe)
    assert ran and all(ran), "the kernel dequantised every call while on"
    for name in ("auto", "leaf"):
        for a, b in zip(outs[(name, True)], outs[(name, False)], strict=True):
            assert torch.equal(a, b), name

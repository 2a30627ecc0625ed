"""The int8 cast kernel on a CUDA device: a unit of int8 weights (per-row and per-tensor scales,
alignment gaps) cast in one launch to the bits of `fp8.dequantize_int8` per weight; and a ComfyUI
int8 file (plain and convrot) streamed in parts gives the bits of the same model placed in mode leaf
(the kernel weight by weight, and torch's cast), CUDA graphs and compiling off."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import dequantize_int8
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.transport import fp8_kernel
from diffusers_offload.offload_core.transport.cast import compute_views
from fixtures import comfy_files
from fixtures.kernels import int8_unit
from fixtures.quantized import wan_pipe
from fixtures.tiny_models import run_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs on a CUDA device")
_comfy_int8_wan = comfy_files.comfy_int8_wan  # the session fixtures, under their own names
_wide_wan_dir = comfy_files.wide_wan_dir
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", cuda_graphs=False, compile_blocks=False)


def test_a_unit_casts_to_the_bits_of_torchs_cast() -> None:
    torch.manual_seed(0)
    scales = [torch.rand(3072, 1) + 0.01, torch.tensor(0.02), torch.rand(130, 1) * 4, torch.rand(3, 1)]
    cast, offsets, region = int8_unit([(3072, 5120), (50, 100), (130, 24), (3, 3)], scales, "cuda")
    shapes, end = cast.shapes, cast.nbytes
    buf = torch.empty(end, dtype=torch.bfloat16, device="cuda")
    for launch in (lambda: fp8_kernel.launch_int8(buf, region, fp8_kernel.int8_table(offsets, shapes, scales,
                                                                                     buf.device, 256), 256),
                   lambda: fp8_kernel.cast_int8_into(buf, region, cast.int8_table(buf.device))):
        buf.fill_(float("nan"))
        assert launch() is not False
        for view, offset, scale, shape in zip(compute_views(buf, cast), offsets, scales, shapes, strict=True):
            want = dequantize_int8(region[offset:offset + shape.numel()].view(shape), scale.cuda(), torch.bfloat16)
            assert torch.equal(view, want), shape


@pytest.mark.parametrize("convrot", [0, 16], ids=["int8", "convrot"])
def test_a_streamed_int8_file_gives_the_bits_of_per_layer_casts(tiny_wan_dir, wide_wan_dir, comfy_int8_wan,
                                                                convrot, monkeypatch) -> None:
    """Streamed in parts (the unit kernel), placed in mode leaf (the kernel weight by weight) and in
    mode leaf with the kernel off (torch's cast): the same bits."""
    file = comfy_int8_wan(per_row=True, wide=wide_wan_dir, convrot=convrot)
    outs = {}
    placements = {"auto": dict(mode="auto", preload="0.0005"), "leaf": dict(mode="leaf"), "torch": dict(mode="leaf")}
    for name, placement in placements.items():
        if name == "torch":
            monkeypatch.setattr(fp8_kernel, "cast_int8_into", lambda *_args: False)
        pipe = wan_pipe(tiny_wan_dir, load_denoiser(file, wide_wan_dir, torch.bfloat16))
        engine = Engine()
        engine.place(pipe, OffloadConfig(**BASE, **placement))
        try:
            outs[name] = run_wan(pipe)
        finally:
            engine.release(pipe)
    assert torch.equal(outs["auto"], outs["leaf"])
    assert torch.equal(outs["leaf"], outs["torch"])

"""ComfyUI int8 files on a CUDA device: plain and convrot (each rotating layer's input rotated on
the device), the model streamed (mode auto, some blocks kept) gives the bits of the same model
placed in mode leaf (a per-layer cast), CUDA graphs and compiling off."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from fixtures import comfy_files
from fixtures.quantized import wan_pipe
from fixtures.tiny_models import run_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
_comfy_int8_wan = comfy_files.comfy_int8_wan  # the session fixtures, under their own names
_wide_wan_dir = comfy_files.wide_wan_dir
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", cuda_graphs=False, compile_blocks=False)


@pytest.mark.parametrize("convrot", [0, 16], ids=["int8", "convrot"])
def test_a_streamed_int8_file_gives_the_bits_of_per_layer_casts(tiny_wan_dir, wide_wan_dir, comfy_int8_wan,
                                                                convrot) -> None:
    file = comfy_int8_wan(per_row=True, wide=wide_wan_dir, convrot=convrot)
    outs = {}
    for name, placement in {"auto": dict(mode="auto", preload="0.0005"), "leaf": dict(mode="leaf")}.items():
        pipe = wan_pipe(tiny_wan_dir, load_denoiser(file, wide_wan_dir, torch.bfloat16))
        engine = Engine()
        engine.place(pipe, OffloadConfig(**BASE, **placement))
        try:
            outs[name] = run_wan(pipe)
        finally:
            engine.release(pipe)
    assert torch.equal(outs["auto"], outs["leaf"])

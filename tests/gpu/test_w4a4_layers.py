"""ConvRot W4A4 layers on a CUDA device: comfy-kitchen's ``convrot_w4a4_linear`` (its GPU kernels)
inside each layer's forward. The wide tiny Wan W4A4 file placed resident, streamed (CUDA graphs on,
run twice: the second replays them), in mode leaf and on demand gives the bits of ComfyUI's own
holding of the file (comfy-kitchen's ``QuantizedTensor`` under ``nn.Linear``) on the same device.
Run on the GPU machine (bench/gpu_batch.sh row ``gputests``)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from fixtures import comfy_files
from fixtures.quantized import placed_on_cuda_give, wan_pipe
from fixtures.tiny_models import run_wan
from fixtures.w4a4_files import GROUP, comfyui_w4a4_twin, write_comfy_w4a4_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="comfy-kitchen's CUDA kernels")
_wide_wan_dir = comfy_files.wide_wan_dir  # (session fixture, under its name)


@pytest.mark.parametrize("linear_dtype", ["int4", "int8"])
def test_a_placed_w4a4_file_gives_comfyuis_bits_on_cuda(linear_dtype, tiny_wan_dir, wide_wan_dir, tmp_path) -> None:
    """(``linear_dtype`` int8: the input quantized to int8, the entries' option; comfy-kitchen's CPU
    path ignores it, so it is checked here only.)"""
    conf = {"format": "convrot_w4a4", "convrot_groupsize": GROUP, "linear_dtype": linear_dtype}
    file = write_comfy_w4a4_wan(wide_wan_dir, tmp_path / "wan-w4a4.safetensors", conf)
    twin = wan_pipe(tiny_wan_dir).to("cuda")
    twin.register_modules(transformer=comfyui_w4a4_twin(file, wide_wan_dir, tmp_path / "twin", "cuda", linear_dtype))
    expected = run_wan(twin).cpu()
    placed_on_cuda_give(lambda: wan_pipe(tiny_wan_dir, load_denoiser(file, wide_wan_dir, torch.bfloat16)), expected)

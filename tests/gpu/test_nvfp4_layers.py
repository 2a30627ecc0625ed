"""NVFP4 layers on a CUDA device: comfy-kitchen's CUDA decode inside each layer's forward. The tiny
Wan NVFP4 file placed resident, streamed (CUDA graphs on, run twice: the second replays them), in
mode leaf and on demand gives the bits of ComfyUI's own holding of the file (comfy-kitchen's
``QuantizedTensor`` under ``nn.Linear``) on the same device. Run on the GPU machine (bench/gpu_batch.sh
row ``gputests``)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from fixtures.nvfp4_files import comfyui_nvfp4_twin, write_comfy_nvfp4_wan
from fixtures.quantized import placed_on_cuda_give, wan_pipe
from fixtures.tiny_models import run_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="comfy-kitchen's CUDA decode")


def test_a_placed_nvfp4_file_gives_comfyuis_bits_on_cuda(tiny_wan_dir, tmp_path) -> None:
    file = write_comfy_nvfp4_wan(tiny_wan_dir, tmp_path / "wan-nvfp4.safetensors")
    twin = wan_pipe(tiny_wan_dir).to("cuda")
    twin.register_modules(transformer=comfyui_nvfp4_twin(file, tiny_wan_dir, tmp_path / "twin", device="cuda"))
    expected = run_wan(twin).cpu()
    placed_on_cuda_give(lambda: wan_pipe(tiny_wan_dir, load_denoiser(file, tiny_wan_dir, torch.bfloat16)), expected)

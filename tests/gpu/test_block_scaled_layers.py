"""NVFP4 and MXFP8 layers on a CUDA device: comfy-kitchen's decode inside each layer's forward (its
CUDA kernel for NVFP4, its torch ops for MXFP8). The tiny Wan file placed resident, streamed (CUDA
graphs on, run twice: the second replays them), in mode leaf and on demand gives the bits of
ComfyUI's own holding of the file (comfy-kitchen's ``QuantizedTensor`` under ``nn.Linear``) on the
same device. Run on the GPU machine (bench/gpu_batch.sh row
``gputests``)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from fixtures.mxfp8_files import comfyui_mxfp8_twin, write_comfy_mxfp8_wan
from fixtures.nvfp4_files import comfyui_nvfp4_twin, write_comfy_nvfp4_wan
from fixtures.quantized import placed_on_cuda_give, wan_pipe
from fixtures.tiny_models import run_wan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA decodes")
FILES = {"nvfp4": (write_comfy_nvfp4_wan, comfyui_nvfp4_twin), "mxfp8": (write_comfy_mxfp8_wan, comfyui_mxfp8_twin)}


@pytest.mark.parametrize("fmt", list(FILES))
def test_a_placed_block_scaled_file_gives_comfyuis_bits_on_cuda(fmt, tiny_wan_dir, tmp_path) -> None:
    write, comfyui_twin = FILES[fmt]
    file = write(tiny_wan_dir, tmp_path / f"wan-{fmt}.safetensors")
    twin = wan_pipe(tiny_wan_dir).to("cuda")
    twin.register_modules(transformer=comfyui_twin(file, tiny_wan_dir, tmp_path / "twin", device="cuda"))
    expected = run_wan(twin).cpu()
    placed_on_cuda_give(lambda: wan_pipe(tiny_wan_dir, load_denoiser(file, tiny_wan_dir, torch.bfloat16)), expected)

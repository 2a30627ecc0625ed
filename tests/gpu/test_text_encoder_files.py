"""Text-encoder files that keep their storage (Comfy-Org's fp8_scaled UMT5, city96's GGUF UMT5) on
a CUDA device (skipped in CI): streamed from pinned memory by the encoder streamer (its fp8 units
cast by the streamer's kernel, the GGUF layers dequantising on the device), the pipeline gives the
bits of mode none on the same device, and no weight stays page-locked after the release."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from fixtures import comfy_files
from fixtures.gguf_text_encoders import t5_state, write_t5_gguf
from fixtures.placements import run_placed_seeing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned streaming needs a CUDA device")

DEVICE = "cuda"
BF16 = torch.bfloat16
_comfy_wan, _configs_only, _component_files = (comfy_files.comfy_wan, comfy_files.wan_configs_only,
                                               comfy_files.wan_component_files)


@pytest.fixture(scope="module", params=["fp8_scaled", "gguf_q8_0"])
def te_file(request, wan_component_files, tmp_path_factory) -> Path:
    source, root = wan_component_files["text_encoder"], tmp_path_factory.mktemp("te-files")
    if request.param == "fp8_scaled":
        return comfy_files.write_fp8_text_encoder(source, root / "umt5-tiny-fp8_scaled.safetensors", scaled=True)
    return write_t5_gguf(t5_state(source), root / "umt5-tiny-encoder-Q8_0.gguf")


def _run(te_file: Path, mode: str, comfy_wan, wan_configs_only, wan_component_files) -> tuple[torch.Tensor, str]:
    pipe = load_pipeline_with_denoiser(wan_configs_only, comfy_wan("bf16"), BF16, te_file, wan_component_files["vae"])
    config = OffloadConfig(mode=mode, on_demand_threshold_gb=0, resident_floor_mb=0, device=DEVICE)
    out, transport = run_placed_seeing(pipe, config, "text_encoder")
    assert not any(t.is_pinned() for t in pipe.text_encoder.parameters())
    return out.cpu(), transport


def test_a_streamed_text_encoder_file_gives_the_bits_of_mode_none(te_file, comfy_wan, wan_configs_only,
                                                                  wan_component_files) -> None:
    streamed, transport = _run(te_file, "auto", comfy_wan, wan_configs_only, wan_component_files)
    resident, _ = _run(te_file, "none", comfy_wan, wan_configs_only, wan_component_files)
    assert transport == "EncoderStreamer"
    assert torch.equal(streamed, resident)

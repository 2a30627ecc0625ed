"""fp8 text-encoder files (Comfy-Org's umt5_xxl_fp8_e4m3fn_scaled, t5xxl_fp8_e4m3fn) keep their fp8
storage: the loaded encoder holds the file's fp8 matrices (half the host RAM and pinned bytes of a
decoded copy), its embedding table decoded, and encodes as ComfyUI does (``w.to(compute) * scale``
at compute) in every placement (the engine dequantises at compute: an fp8 model runs placed);
the file is left unchanged."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import table_of
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from fixtures import comfy_files
from fixtures.placements import run_placed_seeing
from fixtures.tiny_tok import tiny_t5_spiece
from transformers import UMT5EncoderModel

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
PLACEMENTS = {"none": OffloadConfig(mode="none", **BASE), "auto": OffloadConfig(mode="auto", **BASE),
              "leaf": OffloadConfig(mode="leaf", **BASE)}
TRANSPORTS = {"none": "ResidentTransport", "auto": "EncoderStreamer", "leaf": "LeafGroupTransport"}  # what moves the text encoder
_comfy_wan, _configs_only, _component_files = (comfy_files.comfy_wan, comfy_files.wan_configs_only,
                                               comfy_files.wan_component_files)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module", params=["scaled", "plain"])
def te_file(request, wan_component_files, tmp_path_factory) -> Path:
    """(scaled: with its own tokenizer entry, as Comfy-Org's umt5_xxl_fp8_e4m3fn_scaled)"""
    out = tmp_path_factory.mktemp("fp8-te") / f"umt5-tiny-fp8-{request.param}.safetensors"
    scaled = request.param == "scaled"
    return comfy_files.write_fp8_text_encoder(wan_component_files["text_encoder"], out, scaled,
                                              tiny_t5_spiece() if scaled else None)


def _pipe(te_file: Path, comfy_wan, wan_configs_only, wan_component_files):
    return load_pipeline_with_denoiser(wan_configs_only, comfy_wan("fp8"), BF16, te_file, wan_component_files["vae"])


def _twin(tiny_wan_dir: Path, te_file: Path) -> UMT5EncoderModel:
    """The tiny UMT5 holding the file's values as ComfyUI computes with them."""
    twin = UMT5EncoderModel.from_pretrained(str(tiny_wan_dir / "text_encoder"), dtype=BF16)
    values = comfy_files.comfy_dequantised(te_file, BF16)
    missing, unexpected = twin.load_state_dict({k: v.to(BF16) for k, v in values.items()}, strict=False)
    assert not unexpected and set(missing) <= {"encoder.embed_tokens.weight"}  # tied to shared
    return twin


def test_the_encoder_keeps_the_files_fp8_matrices(te_file, comfy_wan, wan_configs_only, wan_component_files) -> None:
    before = _digest(te_file)
    encoder = _pipe(te_file, comfy_wan, wan_configs_only, wan_component_files).text_encoder
    table = table_of(encoder)
    linears = {n for n, m in encoder.named_modules()  # T5's wo stays out: its caller casts inputs to its dtype
               if isinstance(m, torch.nn.Linear) and not n.endswith(".wo")}
    fp8 = {k.removesuffix(".weight") for k, t in comfy_files.load_file(str(te_file)).items() if t.dtype == FP8}
    assert table is not None and table.storage == FP8 and len(table.weights) == len(fp8 & linears) > 0
    assert {n for n, p in encoder.named_parameters() if p.dtype == FP8} == {f"{n}.weight" for n in fp8 & linears}
    assert bool(table.scales) == ("scaled" in te_file.name)
    assert encoder.shared.weight.dtype == BF16 and encoder.dtype == BF16  # the embedding decoded
    assert _digest(te_file) == before


def test_the_files_own_tokenizer_entry_is_left_aside(te_file, comfy_wan, wan_configs_only, wan_component_files,
                                                     caplog) -> None:
    """Comfy-Org's UMT5 files carry the tokenizer ComfyUI's Wan reads (``spiece_model``): the encoder
    loads without it (it was refused as an unexpected weight), the folder's tokenizer reads prompts."""
    has = "spiece_model" in comfy_files.load_file(str(te_file))
    assert has == ("scaled" in te_file.name)
    with caplog.at_level(logging.INFO, logger="diffusers_offload"):
        pipe = _pipe(te_file, comfy_wan, wan_configs_only, wan_component_files)
    told = [r.getMessage() for r in caplog.records if "own tokenizer (spiece_model) is left aside" in r.getMessage()]
    assert len(told) == int(has) and pipe.tokenizer is not None


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_pipeline_runs_as_with_the_decoded_encoder_in_every_placement(
        placement, te_file, comfy_wan, wan_configs_only, wan_component_files, tiny_wan_dir) -> None:
    reference = _pipe(te_file, comfy_wan, wan_configs_only, wan_component_files)
    reference.register_modules(text_encoder=_twin(tiny_wan_dir, te_file))  # (its fp8 denoiser runs placed too)
    expected, _ = run_placed_seeing(reference, PLACEMENTS["none"], "text_encoder")
    pipe = _pipe(te_file, comfy_wan, wan_configs_only, wan_component_files)
    out, transport = run_placed_seeing(pipe, PLACEMENTS[placement], "text_encoder")
    assert torch.equal(out, expected) and transport == TRANSPORTS[placement]
    assert any(p.dtype == FP8 for p in pipe.text_encoder.parameters())  # released: still stored in fp8

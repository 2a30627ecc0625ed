"""FLUX.2 single files under BFL's key names (ComfyUI's FLUX.2 files: fused double-block q, k, v, the
single blocks' ``linear1``, the final modulation as shift-scale) as the denoiser of a FLUX.2 config
folder, through diffusers' own conversion — the 64 GB bf16 model small cards run in fp8: a bf16 file
is the folder's transformer bit for bit; an fp8_scaled one keeps fp8 storage with each split part
taking its fused matrix's scale, and the placed transformer (every placement) gives the bits of the
folder's transformer holding the file's weights as ComfyUI computes them (``w.to(bf16) * scale``);
the file is left unchanged."""

from __future__ import annotations

from pathlib import Path

import diffusers
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import table_of
from diffusers_offload.offload_core.formats.inspect import inspect_safetensors
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from fixtures.comfy_files import comfy_dequantised, comfy_tensors
from fixtures.flux2_files import bfl_flux2_state, tiny_flux2
from fixtures.placements import PLACEMENTS, run_placed
from fixtures.quantized import digest
from safetensors.torch import load_file, save_file

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
QKV = "double_blocks.0.img_attn.qkv"


class TransformerOnly(diffusers.DiffusionPipeline):
    """A pipeline of the transformer alone: what the engine places."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.register_modules(transformer=transformer)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_flux2(tmp_path_factory.mktemp("flux2") / "flux2-tiny")


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("flux2-files")
    state = bfl_flux2_state(load_file(str(next((folder / "transformer").glob("*.safetensors")))))
    for fmt in ("bf16", "fp8_scaled"):
        save_file(comfy_tensors(state, fmt), str(out / f"flux2_tiny_{fmt}.safetensors"))
    return {fmt: out / f"flux2_tiny_{fmt}.safetensors" for fmt in ("bf16", "fp8_scaled")}


def forward(pipe) -> torch.Tensor:
    """One forward of the transformer on a 4 × 4 latent and 8 text tokens, fixed inputs."""
    gen = torch.Generator().manual_seed(0)
    latents, text = torch.randn(1, 16, 16, generator=gen).to(BF16), torch.randn(1, 8, 32, generator=gen).to(BF16)
    img_ids = torch.stack(torch.meshgrid(*(torch.arange(n) for n in (1, 4, 4, 1)), indexing="ij"), -1).reshape(-1, 4)
    txt_ids = torch.zeros(8, 4)
    txt_ids[:, 3] = torch.arange(8)
    with torch.no_grad():
        return pipe.transformer(hidden_states=latents, encoder_hidden_states=text, timestep=torch.tensor([0.5]),
                                img_ids=img_ids, txt_ids=txt_ids, guidance=torch.tensor([4.0]), return_dict=False)[0].float()


def test_a_bf16_file_is_the_folders_transformer(folder, files):
    info = inspect_safetensors(files["bf16"])
    assert (info.role, info.family) == ("denoiser", "flux2") and QKV + ".weight" in info.shapes
    got = load_denoiser(files["bf16"], folder, BF16).state_dict()
    want = diffusers.Flux2Transformer2DModel.from_pretrained(str(folder), subfolder="transformer").state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_an_fp8_scaled_file_runs_as_comfyui_computes_it_in_every_placement(placement, folder, files):
    before = digest(files["fp8_scaled"])
    reference = diffusers.Flux2Transformer2DModel.from_pretrained(str(folder), subfolder="transformer", dtype=BF16)
    reference.load_state_dict(convert_flux2_transformer_checkpoint_to_diffusers(
        comfy_dequantised(files["fp8_scaled"], BF16)), strict=True)
    pipe = TransformerOnly(load_denoiser(files["fp8_scaled"], folder, BF16))
    attention, table = pipe.transformer.transformer_blocks[0].attn, table_of(pipe.transformer)
    parts = [getattr(attention, f"to_{p}").weight for p in "qkv"]
    fused = float(load_file(str(files["fp8_scaled"]))[QKV + ".scale_weight"])
    assert all(w.dtype == FP8 for w in parts) and {table.exact[id(w)] for w in parts} == {fused}
    out = run_placed(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), forward)
    assert torch.equal(out, forward(TransformerOnly(reference)))
    assert all(w.dtype == FP8 for w in parts) and digest(files["fp8_scaled"]) == before

"""Single files of families the pack carries no configs for, in the key names ComfyUI's files use, as
the denoiser of a config folder of their family, through diffusers' own conversion: FLUX.2 (BFL's
names: fused double-block q, k, v, the single blocks' ``linear1``, the final modulation as
shift-scale; 64 GB in bf16) and Qwen-Image (diffusers' own names, which diffusers' detector does
not name: the pack tells it by ``txt_norm``, as ComfyUI does; 41 GB in bf16). A bf16 file is the
folder's transformer bit for bit; fp8 ones (plain, and fp8_scaled with each part of a fused matrix
taking its scale) keep their storage and, placed in every mode, give the bits of the folder's
transformer holding the file's weights as ComfyUI computes them (``w.to(bf16) * scale``); a GGUF file
placed gives the bits of diffusers' own GGUF model; the files are left unchanged."""

from __future__ import annotations

from pathlib import Path

import diffusers
import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import table_of
from diffusers_offload.offload_core.formats.inspect import inspect_file, inspect_safetensors
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from fixtures.comfy_files import FORMATS, comfy_dequantised, comfy_tensors
from fixtures.family_files import FAMILIES, tiny_transformer
from fixtures.gguf_files import write_gguf
from fixtures.placements import PLACEMENTS, run_placed
from fixtures.quantized import digest
from safetensors.torch import load_file, save_file

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
FUSED = "double_blocks.0.img_attn.qkv"  # FLUX.2's image q, k, v in one matrix


class TransformerOnly(diffusers.DiffusionPipeline):
    """A pipeline of the transformer alone: what the engine places."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.register_modules(transformer=transformer)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path, dict[str, Path]]:
    """(family, its config folder, its files by format)."""
    name, spec = request.param, FAMILIES[request.param]
    out = tmp_path_factory.mktemp(name)
    folder = tiny_transformer(spec.cls_name, spec.config, out / "folder")
    state = spec.comfy(load_file(str(next((folder / "transformer").glob("*.safetensors")))))
    for fmt in FORMATS:
        save_file(comfy_tensors(state, fmt), str(out / f"{fmt}.safetensors"))
    files = {fmt: out / f"{fmt}.safetensors" for fmt in FORMATS}
    return name, folder, files | {"Q8_0": write_gguf(state, out / "Q8_0.gguf", "Q8_0", name.replace("-", "_"))}


def forward(name: str, pipe) -> torch.Tensor:
    """The family's forward on fixed inputs (16 latent tokens, 8 text tokens)."""
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, FAMILIES[name].in_channels, generator=gen).to(BF16)
    text = torch.randn(1, 8, 32, generator=gen).to(BF16)
    with torch.no_grad():
        return FAMILIES[name].forward(pipe.transformer, latents, text).float()


def test_a_bf16_file_is_the_folders_transformer(family):
    name, folder, files = family
    info = inspect_safetensors(files["bf16"])
    assert (info.role, info.family) == ("denoiser", name)
    got = load_denoiser(files["bf16"], folder, BF16).state_dict()
    want = getattr(diffusers, FAMILIES[name].cls_name).from_pretrained(str(folder), subfolder="transformer").state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_scaled"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_an_fp8_file_runs_as_comfyui_computes_it_in_every_placement(placement, fmt, family):
    name, folder, files = family
    before = digest(files[fmt])
    cls = getattr(diffusers, FAMILIES[name].cls_name)
    reference = cls.from_pretrained(str(folder), subfolder="transformer", dtype=BF16)
    reference.load_state_dict(FAMILIES[name].convert(comfy_dequantised(files[fmt], BF16)), strict=True)
    pipe = TransformerOnly(load_denoiser(files[fmt], folder, BF16))
    table = table_of(pipe.transformer)
    assert table.weights and all(p.dtype in (FP8, BF16, torch.float32) for p in pipe.transformer.parameters())
    if name == "flux2" and fmt == "fp8_scaled":
        attention = pipe.transformer.transformer_blocks[0].attn
        fused = float(load_file(str(files[fmt]))[FUSED + ".scale_weight"])
        assert {table.exact[id(getattr(attention, f"to_{p}").weight)] for p in "qkv"} == {fused}
    out = run_placed(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), lambda p: forward(name, p))
    assert torch.equal(out, forward(name, TransformerOnly(reference)))
    assert sum(p.dtype == FP8 for p in pipe.transformer.parameters()) == len(table.weights)  # released: still fp8
    assert digest(files[fmt]) == before


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_gguf_file_runs_as_diffusers_reads_it_in_every_placement(placement, family):
    """(Q8_0, written by the `gguf` package in the file's key names: the transformer diffusers'
    GGUF quantizer loads, unplaced, is the reference.)"""
    from diffusers import GGUFQuantizationConfig
    from diffusers.quantizers.gguf.utils import GGUFParameter

    name, folder, files = family
    assert inspect_file(files["Q8_0"]).family == name
    reference = getattr(diffusers, FAMILIES[name].cls_name).from_single_file(
        str(files["Q8_0"]), config=str(folder), subfolder="transformer", local_files_only=True,
        quantization_config=GGUFQuantizationConfig(compute_dtype=BF16))
    pipe = TransformerOnly(load_denoiser(files["Q8_0"], folder, BF16))
    assert any(isinstance(p, GGUFParameter) for p in pipe.transformer.parameters())
    out = run_placed(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), lambda p: forward(name, p))
    assert torch.equal(out, forward(name, TransformerOnly(reference)))

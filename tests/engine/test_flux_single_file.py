"""FLUX.1 single files in BFL's key layout (tests/fixtures/flux_files.py) through the pack's loader:
a bf16 file runs as the tiny Flux pipeline itself, a Comfy-Org fp8_scaled file as the bf16 twin
holding ``fp8.to(bf16) * scale.to(bf16)`` (one scale per fused qkv / linear1 tensor, carried by
each of its split parts), a city96-style GGUF Q8_0 file as the same GGUF model resident and within
Q8_0's error of bf16; placed in mode none, auto and auto with every block kept; no file changes.

diffusers' Flux converter only splits FLUX.1's width (3072): the tests run it through
`flux_files.tiny_width_conversion` (zero-padded, trimmed back), see that module.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline, FluxTransformer2DModel
from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats import carried
from diffusers_offload.offload_core.formats.fp8 import table_of
from diffusers_offload.offload_core.formats.inspect import SingleFileError, inspect_safetensors
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from diffusers_offload.offload_core.state import leftovers
from fixtures import flux_files
from fixtures.comfy_files import carried_like_copy, configs_only_copy, write_component_file
from fixtures.flux_files import bfl_flux_state_dict, ldm_vae_state_dict, tiny_width_conversion
from fixtures.placements import PLACEMENTS
from fixtures.tiny_models import run_flux
from safetensors.torch import load_file, save_file

_bfl_flux, _flux_tiny_width = flux_files.bfl_flux, flux_files.flux_tiny_width  # fixtures, under their names
pytestmark = pytest.mark.usefixtures("flux_tiny_width")
BF16 = torch.bfloat16
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
MODES = ("none", "auto", "auto-keep-all")
Q8_0_BOUND = 0.02  # relative L2 error vs the bf16 run: measured 0.5 % here, 0.6 % on the tiny Wan
_RUNS: dict[str, torch.Tensor] = {}


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def flux_no_transformer(tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Flux folder with every weight but the transformer's: the denoiser must come from the file."""
    out = tmp_path_factory.mktemp("flux-configs") / "tiny-flux"
    shutil.copytree(
        tiny_flux_dir,
        out,
        ignore=lambda d, names: [n for n in names if Path(d).name == "transformer" and n != "config.json"],
    )
    return out


def _run_placed(pipe, placement: str) -> torch.Tensor:
    engine = Engine()
    engine.place(pipe, OffloadConfig(**BASE, **PLACEMENTS[placement]))
    try:
        return run_flux(pipe)
    finally:
        engine.release(pipe)
        assert leftovers(pipe.transformer) == []


def _folder_pipe(tiny_flux_dir: Path, transformer: torch.nn.Module | None = None):
    """The tiny Flux folder loaded by diffusers in bf16, with ``transformer`` in place of its own."""
    pipe = DiffusionPipeline.from_pretrained(str(tiny_flux_dir), dtype=BF16)
    pipe.set_progress_bar_config(disable=True)
    if transformer is not None:
        pipe.register_modules(transformer=transformer)
    return pipe


def _once(key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    if key not in _RUNS:
        _RUNS[key] = make()
    return _RUNS[key]


# -- the fixture files ---------------------------------------------------------------------------
def test_diffusers_converter_splits_flux1_width_only(tiny_flux_dir):
    """Why the shim: diffusers' converter (inner_dim 3072 written in) cannot split the tiny linear1.
    When this fails, diffusers reads the width from the config: drop `tiny_width_conversion`."""
    with pytest.raises(RuntimeError, match="split_with_sizes"):
        convert_flux_transformer_checkpoint_to_diffusers(bfl_flux_state_dict(tiny_flux_dir))


def test_bfl_layout_converts_back_exactly(tiny_flux_dir, bfl_flux):
    """The inverse is exact in fp32, and diffusers' own `from_single_file` of the bf16 file gives the
    folder's transformer in bf16 bit for bit."""
    folder = FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    expected = folder.state_dict()
    bfl = bfl_flux_state_dict(tiny_flux_dir)
    assert "double_blocks.0.img_attn.qkv.weight" in bfl and "single_blocks.0.linear1.weight" in bfl
    back = tiny_width_conversion(bfl, config=dict(folder.config))
    assert set(back) == set(expected) and all(torch.equal(back[k], expected[k]) for k in expected)
    loaded = FluxTransformer2DModel.from_single_file(
        str(bfl_flux("bf16")),
        config=str(tiny_flux_dir),
        subfolder="transformer",
        local_files_only=True,
        torch_dtype=BF16,
    )
    ours = loaded.state_dict()
    assert all(torch.equal(ours[k], v.to(BF16)) for k, v in expected.items())


def test_inspect_reads_flux_files(bfl_flux):
    bf16, scaled = inspect_safetensors(bfl_flux("bf16")), inspect_safetensors(bfl_flux("fp8_scaled"))
    assert (bf16.role, bf16.family, bf16.format) == ("denoiser", "flux", "bf16")
    assert (scaled.family, scaled.format, scaled.marker) == ("flux", "fp8_e4m3fn_scaled", "scaled_fp8")
    assert scaled.scales["double_blocks.0.img_attn.qkv"] == "double_blocks.0.img_attn.qkv.scale_weight"
    assert "single_blocks.0.linear1" in scaled.scales


# -- bf16 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", MODES)
def test_bf16_file_runs_as_the_tiny_flux(placement, bfl_flux, flux_no_transformer, tiny_flux_dir):
    path = bfl_flux("bf16")
    before = _digest(path)
    pipe = load_pipeline_with_denoiser(flux_no_transformer, path, BF16)
    assert table_of(pipe.transformer) is None
    expected = _once("bf16", lambda: run_flux(_folder_pipe(tiny_flux_dir)))
    assert torch.equal(_run_placed(pipe, placement), expected)
    assert _digest(path) == before


# -- fp8_scaled ----------------------------------------------------------------------------------
def _dequantised_twin(path: Path, tiny_flux_dir: Path) -> FluxTransformer2DModel:
    """The file's weights as ComfyUI computes them (``fp8.to(bf16) * scale.to(bf16)``, on the fused
    tensors), converted by diffusers' converter, loaded into a bf16 model."""
    tensors = load_file(str(path))
    dequantised = {}
    for key, t in tensors.items():
        if key == "scaled_fp8" or key.endswith(".scale_weight"):
            continue
        scale = tensors.get(key.removesuffix(".weight") + ".scale_weight")
        dequantised[key] = t.to(BF16) if scale is None else t.to(BF16) * scale.to(BF16)
    config = FluxTransformer2DModel.load_config(str(tiny_flux_dir / "transformer"))
    model = FluxTransformer2DModel.from_config(config).to(BF16)
    model.load_state_dict(tiny_width_conversion(dequantised, config=config), strict=True)
    return model.eval()


def test_a_fused_scale_reaches_each_split_part(bfl_flux, tiny_flux_dir):
    """One scale on img_attn.qkv / linear1: to_q, to_k, to_v (and proj_mlp) each carry it."""
    path = bfl_flux("fp8_scaled")
    model = load_denoiser(path, tiny_flux_dir, BF16)
    table, file = table_of(model), load_file(str(path))
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    qkv = file["double_blocks.0.img_attn.qkv.scale_weight"].to(BF16).item()  # held in compute
    linear1 = file["single_blocks.0.linear1.scale_weight"].to(BF16).item()
    for layer in (double.attn.to_q, double.attn.to_k, double.attn.to_v):
        assert layer.weight.dtype == torch.float8_e4m3fn and table.scale_of(layer.weight) == qkv
    for layer in (single.attn.to_q, single.attn.to_k, single.attn.to_v, single.proj_mlp):
        assert table.scale_of(layer.weight) == linear1


def test_a_fused_static_input_scale_reaches_each_split_part(tiny_flux_dir, tmp_path):
    """A ``scale_input`` on img_attn.qkv / linear1 (dropped by diffusers' Flux conversion, traced
    through it): to_q, to_k, to_v (and proj_mlp) each quantise their input at it; no other layer has one."""
    path = tmp_path / "flux-static.safetensors"
    tensors = flux_files.bfl_flux_tensors(tiny_flux_dir, "fp8_scaled")
    tensors["double_blocks.0.img_attn.qkv.scale_input"] = torch.tensor(0.25)
    tensors["single_blocks.0.linear1.scale_input"] = torch.tensor(0.5)
    save_file(tensors, str(path))
    model = load_denoiser(path, tiny_flux_dir, BF16)
    table = table_of(model)
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    expected = {id(layer.weight): 0.25 for layer in (double.attn.to_q, double.attn.to_k, double.attn.to_v)}
    expected |= {id(layer.weight): 0.5 for layer in (single.attn.to_q, single.attn.to_k, single.attn.to_v,
                                                       single.proj_mlp)}
    assert table.inputs == expected


@pytest.mark.parametrize("placement", MODES)
def test_fp8_scaled_file_runs_as_the_dequantised_twin(
    placement, bfl_flux, flux_no_transformer, tiny_flux_dir
):
    path = bfl_flux("fp8_scaled")
    before = _digest(path)
    try:
        pipe = load_pipeline_with_denoiser(flux_no_transformer, path, BF16)
    finally:
        assert _digest(path) == before
    assert len(table_of(pipe.transformer).scales) > 0
    expected = _once(
        "fp8_scaled", lambda: run_flux(_folder_pipe(tiny_flux_dir, _dequantised_twin(path, tiny_flux_dir)))
    )
    assert torch.equal(_run_placed(pipe, placement), expected)
    assert _digest(path) == before


# -- GGUF ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", MODES)
def test_gguf_file_runs_as_the_resident_gguf_model(placement, bfl_flux, flux_no_transformer, tiny_flux_dir):
    path = bfl_flux("Q8_0")
    before = _digest(path)
    pipe = load_pipeline_with_denoiser(flux_no_transformer, path, BF16)
    q = pipe.transformer.single_transformer_blocks[0].attn.to_q.weight  # split from the fused linear1
    assert type(q).__name__ == "GGUFParameter" and q.quant_type.name == "Q8_0" and q.dtype == torch.uint8
    resident = _once(
        "gguf", lambda: _run_placed(load_pipeline_with_denoiser(flux_no_transformer, path, BF16), "none")
    )
    got = _run_placed(pipe, placement)
    assert torch.equal(got, resident)
    bf16 = _once("bf16", lambda: run_flux(_folder_pipe(tiny_flux_dir)))
    assert ((got.float() - bf16.float()).norm() / bf16.float().norm()).item() < Q8_0_BOUND
    assert _digest(path) == before


def test_a_gguf_file_of_another_family_is_refused_by_name(bfl_flux, tiny_wan_dir):
    """A Flux GGUF file given with a Wan config folder: refused before diffusers reads it, saying
    what the file is (its key names, as for a safetensors file); the file is unchanged."""
    path = bfl_flux("Q8_0")
    before = _digest(path)
    with pytest.raises(SingleFileError, match=r"is a flux denoiser, but the config folder .* is a wan model") as err:
        load_denoiser(path, tiny_wan_dir, BF16)
    assert path.name in str(err.value) and _digest(path) == before


def test_a_configs_only_flux_folder_takes_both_text_encoder_files_and_the_vae(bfl_flux, tiny_flux_dir, tmp_path):
    """What a Flux user holds: the denoiser, clip_l, t5xxl and ae files beside a configs-only
    folder. CLIP-L goes in as text_encoder, T5 as text_encoder_2; the run is the tiny Flux's."""
    configs = configs_only_copy(tiny_flux_dir, tmp_path / "flux-configs")
    parts = {name: write_component_file(tiny_flux_dir, name, tmp_path / f"{name}.safetensors")
             for name in ("text_encoder", "text_encoder_2", "vae")}
    with pytest.raises(SingleFileError, match="no weights for text_encoder_2 .*pick a second text-encoder file"):
        load_pipeline_with_denoiser(configs, bfl_flux("bf16"), BF16, text_encoder_file=parts["text_encoder"],
                                    vae_file=parts["vae"])
    pipe = load_pipeline_with_denoiser(configs, bfl_flux("bf16"), BF16, text_encoder_file=parts["text_encoder"],
                                       vae_file=parts["vae"], text_encoder_2_file=parts["text_encoder_2"])
    expected = _once("bf16", lambda: run_flux(_folder_pipe(tiny_flux_dir)))
    assert torch.equal(_run_placed(pipe, "auto"), expected)



def test_flux_files_run_with_the_configs_the_pack_carries_and_comfyuis_tokenizers(bfl_flux, tiny_flux_dir, tmp_path):
    """A carried FLUX.1 folder holds no tokenizer: its ``tokenizers.json`` names the folders ComfyUI
    ships CLIP-L's and T5's in. The tiny Flux's configs (less weights and tokenizers, with that
    file) stand for a carried folder, its tokenizers saved where ComfyUI keeps its own: the file
    picks that folder and, with the VAE in the LDM layout of BFL's ae.safetensors, runs as the tiny
    Flux; without ComfyUI's folder, or with its files gone, refused by name."""
    folder = carried_like_copy(tiny_flux_dir, tmp_path / "carried" / "tiny-flux")
    shutil.copyfile(carried.by_name("FLUX.1-dev") / "tokenizers.json", folder / "tokenizers.json")
    comfy = tmp_path / "ComfyUI" / "comfy"
    shutil.copytree(tiny_flux_dir / "tokenizer", comfy / "sd1_tokenizer")
    shutil.copytree(tiny_flux_dir / "tokenizer_2", comfy / "text_encoders" / "t5_tokenizer")
    assert carried.pick(bfl_flux("bf16"), False, folder.parent) == folder
    files = {f"{name}_file": write_component_file(tiny_flux_dir, name, tmp_path / f"{name}.safetensors")
             for name in ("text_encoder", "text_encoder_2")}
    save_file(ldm_vae_state_dict(tiny_flux_dir), str(tmp_path / "ae.safetensors"))  # BFL's VAE file: LDM layout
    files["vae_file"] = tmp_path / "ae.safetensors"
    pipe = load_pipeline_with_denoiser(folder, bfl_flux("bf16"), BF16, comfy_tokenizers=comfy, **files)
    assert torch.equal(_run_placed(pipe, "auto"), _once("bf16", lambda: run_flux(_folder_pipe(tiny_flux_dir))))
    with pytest.raises(SingleFileError, match="takes its tokenizer from ComfyUI's sd1_tokenizer folder, which was not"):
        load_pipeline_with_denoiser(folder, bfl_flux("bf16"), BF16, **files)
    for f in (comfy / "sd1_tokenizer").iterdir():  # a ComfyUI install without its tokenizer files
        f.unlink()
    with pytest.raises(SingleFileError, match=r"sd1_tokenizer holds none of its vocabulary files \(merges.txt, tokenizer.json, vocab.json; it holds \[\]\)"):
        load_pipeline_with_denoiser(folder, bfl_flux("bf16"), BF16, comfy_tokenizers=comfy, **files)

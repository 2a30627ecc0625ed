"""FLUX.2 [klein] from ComfyUI's files alone: the carried configs (4B and 9B, distilled and base) are
the released models' shapes, a file picks its folder by shape and, between distilled and base, by
name; the denoiser under BFL's names, the Qwen3 text encoder in ComfyUI's layout (the 8B file's head
left out) and the VAE as ``flux2-vae.safetensors`` holds it (which diffusers has no single-file loader
for) run with the configs the pack carries and ComfyUI's own tokenizer folder. The tiny model's
configs, with the carried ``tokenizers.json``, stand for the carried folder: an fp8_scaled denoiser
gives, in every placement, the bits of the folder's pipeline holding the file's weights as ComfyUI
computes them, a GGUF one those of diffusers' own GGUF model; the files are left unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import pytest
import torch
import transformers
from accelerate import init_empty_weights
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats import carried
from diffusers_offload.offload_core.formats.inspect import SingleFileError, describe_keys
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser, load_vae
from fixtures.comfy_files import carried_like_with_tokenizers, comfy_dequantised, comfy_tensors
from fixtures.family_files import bfl_flux2_state
from fixtures.flux2_klein_files import (
    build_tiny_flux2_klein,
    comfy_flux2_klein_files,
    flux2_vae_state,
    run_flux2_klein,
    transformer_state,
)
from fixtures.placements import PLACEMENTS, run_placed
from fixtures.quantized import digest
from safetensors.torch import save_file

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
KLEIN = {"4B": ("FLUX.2-klein-4B", "FLUX.2-klein-base-4B", 2560), "9B": ("FLUX.2-klein-9B", "FLUX.2-klein-base-9B", 4096)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_flux2_klein(tmp_path_factory.mktemp("flux2-klein") / "flux2-klein-tiny")


@pytest.fixture(scope="module")
def denoiser(folder, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("flux2-klein-files") / "flux-2-klein-tiny-fp8_scaled.safetensors"
    save_file(comfy_tensors(transformer_state(folder), "fp8_scaled"), str(path))
    return path


@pytest.fixture(scope="module")
def carried_like(folder, tmp_path_factory) -> tuple[Path, Path]:
    return carried_like_with_tokenizers(folder, tmp_path_factory.mktemp("flux2-klein-carried"), "FLUX.2-klein-4B")


def _meta(cls: type, folder: Path) -> torch.nn.Module:
    with init_empty_weights():
        if issubclass(cls, diffusers.ModelMixin):
            return cls.from_config(cls.load_config(str(folder)))
        return cls(cls.config_class.from_pretrained(str(folder)))


@pytest.mark.parametrize("size", list(KLEIN))
def test_the_carried_klein_folders_fit_their_parts(size: str) -> None:
    """Each size's distilled and base folders: the same transformer, reading three of its Qwen3's hidden
    states stacked (3 × its width) and the FLUX.2 VAE's 32 latent channels patched 2 × 2; the
    pipeline's ``is_distilled`` tells them apart; the tokenizer ComfyUI's Qwen folder."""
    distilled, base = (carried.by_name(n) for n in KLEIN[size][:2])
    configs = [json.loads((f / "transformer" / "config.json").read_text()) for f in (distilled, base)]
    assert {k: v for k, v in configs[0].items() if not k.startswith("_")} == \
           {k: v for k, v in configs[1].items() if not k.startswith("_")}
    text = _meta(transformers.Qwen3Model, distilled / "text_encoder")
    vae = _meta(diffusers.AutoencoderKLFlux2, distilled / "vae")
    assert text.config.hidden_size == KLEIN[size][2] and configs[0]["joint_attention_dim"] == 3 * KLEIN[size][2]
    assert configs[0]["in_channels"] == vae.config.latent_channels * 4 == vae.bn.num_features
    assert [json.loads((f / "model_index.json").read_text())["is_distilled"] for f in (distilled, base)] == [True, False]
    assert json.loads((distilled / "tokenizers.json").read_text())["tokenizer"]["comfyui"] == "text_encoders/qwen25_tokenizer"


def test_the_carried_4b_transformer_is_the_size_of_bfls_fp8_file() -> None:
    """BFL's ``flux-2-klein-4b-fp8.safetensors`` is 4,070,624,520 bytes: the carried 4B transformer's
    block matrices in fp8 and its other tensors in bf16 are all of it but its header and scales."""
    model = _meta(diffusers.Flux2Transformer2DModel, carried.by_name("FLUX.2-klein-4B") / "transformer")
    blocks = ("transformer_blocks.", "single_transformer_blocks.")
    fp8 = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(blocks))
    nbytes = fp8 + 2 * (sum(p.numel() for p in model.parameters()) - fp8)
    assert nbytes == pytest.approx(4_070_624_520, rel=1e-4)


@pytest.mark.parametrize("size", list(KLEIN))
def test_a_released_klein_shape_picks_its_folder_distilled_or_base_by_name(size: str) -> None:
    distilled, base = (carried.by_name(n) for n in KLEIN[size][:2])
    model = _meta(diffusers.Flux2Transformer2DModel, distilled / "transformer")
    shapes = {k: tuple(t.shape) for k, t in bfl_flux2_state(model.state_dict()).items()}
    for name, want in ((f"flux-2-klein-{size.lower()}-fp8.safetensors", distilled),
                       (f"flux-2-klein-base-{size.lower()}.safetensors", base)):
        info = describe_keys(Path(name), shapes)
        assert info.family == "flux2" and carried.choose(info, False, carried.carried()) == want
    dev = {**shapes, "guidance_in.in_layer.weight": (shapes["img_in.weight"][0], 256)}
    with pytest.raises(SingleFileError, match="a guidance input.*none of the configs the pack carries"):
        carried.choose(describe_keys(Path("flux2_dev.safetensors"), dev), False, carried.carried())


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_comfyuis_files_run_with_the_carried_configs_in_every_placement(placement, folder, denoiser, carried_like,
                                                                        tmp_path):
    """With the 8B kind of Qwen3 file (a head beside the model), the head left out."""
    configs, package = carried_like
    parts = comfy_flux2_klein_files(folder, tmp_path / "parts", head=True)
    before = {p: digest(p) for p in (denoiser, *parts.values())}
    assert carried.pick(denoiser, False, configs.parent) == configs
    pipe = load_pipeline_with_denoiser(configs, denoiser, BF16, comfy_tokenizers=package,
                                       text_encoder_file=parts["text_encoder"], vae_file=parts["vae"])
    assert pipe.transformer.transformer_blocks[0].attn.to_q.weight.dtype == FP8
    reference = diffusers.Flux2KleinPipeline.from_pretrained(str(folder), dtype=BF16)
    reference.transformer.load_state_dict(_diffusers_names(comfy_dequantised(denoiser, BF16)), strict=True)
    assert torch.equal(run_placed(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), run_flux2_klein),
                       run_flux2_klein(reference))
    assert {p: digest(p) for p in before} == before


def test_a_gguf_file_runs_with_the_carried_configs_as_diffusers_reads_it(folder, carried_like, tmp_path):
    """A Q8_0 GGUF file (the community Klein files' kind: BFL's names) written by the `gguf` package
    picks the carried folder and, placed, gives the bits of the folder's pipeline holding diffusers'
    own GGUF model of the file."""
    from diffusers import GGUFQuantizationConfig
    from diffusers.quantizers.gguf.utils import GGUFParameter
    from fixtures.gguf_files import write_gguf

    gguf = write_gguf({k: t.float() for k, t in transformer_state(folder).items()}, tmp_path / "flux-2-klein-Q8_0.gguf",
                      "Q8_0", "flux")
    configs, package = carried_like
    assert carried.pick(gguf, False, configs.parent) == configs
    transformer = diffusers.Flux2Transformer2DModel.from_single_file(
        str(gguf), config=str(folder), subfolder="transformer", local_files_only=True,
        quantization_config=GGUFQuantizationConfig(compute_dtype=BF16))
    reference = run_flux2_klein(diffusers.Flux2KleinPipeline.from_pretrained(str(folder), transformer=transformer,
                                                                             dtype=BF16))
    parts = comfy_flux2_klein_files(folder, tmp_path / "parts")
    pipe = load_pipeline_with_denoiser(configs, gguf, BF16, comfy_tokenizers=package,
                                       text_encoder_file=parts["text_encoder"], vae_file=parts["vae"])
    assert any(isinstance(w, GGUFParameter) for w in pipe.transformer.parameters())  # kept packed
    assert torch.equal(run_placed(pipe, OffloadConfig(**PLACEMENTS["auto"], **BASE), run_flux2_klein), reference)


def test_the_vae_as_bfl_holds_it_is_the_folders_vae(folder, tmp_path):
    """diffusers' LDM converter with the quant convolutions moved: the folder's VAE, statistics
    included, bit for bit; FLUX.1's ``ae.safetensors`` (no statistics) is refused by name."""
    want = diffusers.AutoencoderKLFlux2.from_pretrained(str(folder / "vae")).state_dict()
    path = tmp_path / "flux2-vae.safetensors"
    save_file(flux2_vae_state(folder), str(path))
    got = load_vae(path, folder, BF16).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)
    flux1 = tmp_path / "ae.safetensors"
    save_file({k: t for k, t in flux2_vae_state(folder).items() if not k.startswith("bn.")}, str(flux1))
    with pytest.raises(SingleFileError, match=r"ae\.safetensors has no latent statistics.*flux2-vae\.safetensors"):
        load_vae(flux1, folder, BF16)


def _diffusers_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    return convert_flux2_transformer_checkpoint_to_diffusers(state)

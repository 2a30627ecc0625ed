"""FLUX.2 [dev] from ComfyUI's files alone: the carried configs are the released model's shapes and a
file of its shape picks them; the denoiser under BFL's names, Mistral Small's language model in
ComfyUI's layout carrying its tekken vocabulary (the tokenizer: the carried folder has none) and the
VAE as ``flux2-vae.safetensors`` holds it run with the configs the pack carries. The tiny model's
configs (no tokenizer) stand for the carried folder: an fp8_scaled denoiser gives, in every
placement, the bits of the folder's pipeline holding the file's weights as ComfyUI computes them, its
tokenizer the one the folder saved from the same vocabulary; the files are left unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import pytest
import torch
import transformers
from accelerate import init_empty_weights
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats import carried
from diffusers_offload.offload_core.formats.file_tokenizers import tokenizer_from_file
from diffusers_offload.offload_core.formats.inspect import describe_keys
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from fixtures.comfy_files import carried_like_copy, comfy_dequantised, comfy_tensors
from fixtures.family_files import bfl_flux2_state
from fixtures.flux2_dev_files import build_tiny_flux2_dev, comfy_flux2_dev_files, run_flux2_dev
from fixtures.flux2_klein_files import transformer_state
from fixtures.placements import PLACEMENTS, run_placed
from fixtures.quantized import digest
from safetensors.torch import save_file

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
FOLDER = "FLUX.2-dev"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_flux2_dev(tmp_path_factory.mktemp("flux2-dev") / "flux2-dev-tiny")


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("flux2-dev-files")
    save_file(comfy_tensors(transformer_state(folder), "fp8_scaled"), str(out / "flux2_dev_tiny_fp8_scaled.safetensors"))
    return {"denoiser": out / "flux2_dev_tiny_fp8_scaled.safetensors", **comfy_flux2_dev_files(folder, out)}


def _meta(cls: type, path: Path) -> torch.nn.Module:
    with init_empty_weights():
        if issubclass(cls, diffusers.ModelMixin):
            return cls.from_config(cls.load_config(str(path)))
        return cls(cls.config_class.from_pretrained(str(path)))


def test_the_carried_dev_folder_fits_its_parts_and_its_shape_picks_it() -> None:
    """The transformer reads three of the Mistral model's hidden states stacked (3 × its width) and
    the FLUX.2 VAE's 32 latent channels patched 2 × 2, and has a guidance input; a file of its shape
    (BFL's names) picks the folder; no tokenizer is carried (the text-encoder file has it)."""
    path = carried.by_name(FOLDER)
    config = json.loads((path / "transformer" / "config.json").read_text())
    text = _meta(transformers.MistralModel, path / "text_encoder")
    vae = _meta(diffusers.AutoencoderKLFlux2, path / "vae")
    assert config["joint_attention_dim"] == 3 * text.config.hidden_size and len(text.layers) > 30
    assert config["in_channels"] == vae.config.latent_channels * 4 and config["guidance_embeds"]
    assert not (path / carried.SHIPPED).exists() and not (path / "tokenizer").exists()
    model = _meta(diffusers.Flux2Transformer2DModel, path / "transformer")
    shapes = {k: tuple(t.shape) for k, t in bfl_flux2_state(model.state_dict()).items()}
    info = describe_keys(Path("flux2_dev_fp8mixed.safetensors"), shapes)
    assert info.family == "flux2" and carried.choose(info, False, carried.carried()) == path


def test_the_tokenizer_is_read_from_the_tekken_vocabulary_the_text_encoder_file_carries(folder, files):
    ours = tokenizer_from_file(files["text_encoder"], "PreTrainedTokenizerFast", "the test")
    saved = diffusers.Flux2Pipeline.from_pretrained(str(folder), transformer=None, vae=None, text_encoder=None).tokenizer
    messages = [[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                 {"role": "user", "content": [{"type": "text", "text": "a red fox"}]}]]
    kwargs = dict(tokenize=True, return_dict=True, padding="max_length", max_length=32)
    assert ours.apply_chat_template(messages, **kwargs)["input_ids"] == saved.apply_chat_template(messages, **kwargs)["input_ids"]
    assert ours.padding_side == "left" and ours.chat_template == saved.chat_template


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_comfyuis_files_run_with_the_carried_configs_in_every_placement(placement, folder, files, tmp_path):
    configs = carried_like_copy(folder, tmp_path / "carried" / "flux2-dev-tiny")
    before = {p: digest(p) for p in files.values()}
    assert carried.pick(files["denoiser"], False, configs.parent) == configs
    pipe = load_pipeline_with_denoiser(configs, files["denoiser"], BF16, text_encoder_file=files["text_encoder"],
                                       vae_file=files["vae"])
    assert pipe.transformer.transformer_blocks[0].attn.to_q.weight.dtype == FP8
    reference = diffusers.Flux2Pipeline.from_pretrained(str(folder), dtype=BF16)
    reference.transformer.load_state_dict(
        convert_flux2_transformer_checkpoint_to_diffusers(comfy_dequantised(files["denoiser"], BF16)), strict=True)
    assert torch.equal(run_placed(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), run_flux2_dev),
                       run_flux2_dev(reference))
    assert {p: digest(p) for p in before} == before


def test_a_pruned_mistral_file_runs_as_the_whole_model(folder, files, tmp_path):
    """ComfyUI's pruned Mistral Small files stop after the layers FLUX.2 reads, without the final
    norm: the model is built to the file's depth (a norm-free end), and the pipeline gives the bits it
    gives with the whole model."""
    from safetensors.torch import load_file

    whole = load_file(str(files["text_encoder"]))
    pruned = tmp_path / "mistral_3_small_flux2_pruned.safetensors"
    save_file({k: t for k, t in whole.items() if k != "model.norm.weight" and not k.startswith("model.layers.30.")},
              str(pruned))
    configs = carried_like_copy(folder, tmp_path / "carried" / "flux2-dev-tiny")
    outputs = []
    for text_encoder in (files["text_encoder"], pruned):
        pipe = load_pipeline_with_denoiser(configs, files["denoiser"], BF16, text_encoder_file=text_encoder,
                                           vae_file=files["vae"])
        outputs.append(run_placed(pipe, OffloadConfig(**PLACEMENTS["auto"], **BASE), run_flux2_dev))
    assert len(pipe.text_encoder.layers) == 30 and isinstance(pipe.text_encoder.norm, torch.nn.Identity)
    assert torch.equal(*outputs)


def test_a_damaged_tekken_vocabulary_is_refused_naming_the_file(tmp_path):
    from diffusers_offload.offload_core.formats.inspect import SingleFileError

    path = tmp_path / "mistral_damaged.safetensors"
    save_file({"model.norm.weight": torch.ones(4), "tekken_model": torch.tensor(list(b"{not json"), dtype=torch.uint8)},
              str(path))
    with pytest.raises(SingleFileError, match=r"the tekken vocabulary mistral_damaged\.safetensors carries could not be read"):
        tokenizer_from_file(path, "PreTrainedTokenizerFast", "the test")

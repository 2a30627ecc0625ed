"""Qwen-Image from ComfyUI's files alone: the denoiser (Comfy-Org's ``qwen_image_*`` files hold
diffusers' names), the Qwen2.5-VL text encoder in ComfyUI's layout (``qwen_2.5_vl_7b``: ``model.*``,
``visual.*``, ``lm_head``) and the VAE in Wan 2.1's original layout (``qwen_image_vae``, which diffusers
has no single-file loader for), with the configs the pack carries and ComfyUI's own tokenizer folder.
The tiny model's configs, with the carried ``tokenizers.json``, stand for the carried folder: an
fp8_scaled denoiser picks it and gives, in every placement, the bits of the folder's pipeline holding
the file's weights as ComfyUI computes them, and a GGUF one as diffusers' own GGUF model; fp8_scaled and
GGUF (llama.cpp's ``qwen2vl``) text encoders keep their storage; the files are left unchanged."""

from __future__ import annotations

from pathlib import Path

import diffusers
import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats import carried
from diffusers_offload.offload_core.formats.inspect import SingleFileError
from diffusers_offload.offload_core.formats.single_file_pipeline import (
    load_pipeline_with_denoiser,
    load_text_encoder,
    load_vae,
)
from diffusers_offload.offload_core.formats.vae_layouts import MARKER
from fixtures.comfy_files import carried_like_with_tokenizers, comfy_dequantised, comfy_tensors
from fixtures.placements import PLACEMENTS, run_placed
from fixtures.quantized import digest
from fixtures.qwen_image_files import (
    build_tiny_qwen_image,
    comfy_qwen_image_files,
    comfy_text_encoder_state,
    run_qwen_image,
    text_encoder_state,
    transformer_state,
)
from safetensors.torch import load_file, save_file

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
TE = "Qwen2_5_VLForConditionalGeneration"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_qwen_image(tmp_path_factory.mktemp("qwen-image") / "qwen-image-tiny")


@pytest.fixture(scope="module")
def denoiser(folder, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen-image-files") / "qwen_image_tiny_fp8_scaled.safetensors"
    save_file(comfy_tensors(transformer_state(folder), "fp8_scaled"), str(path))
    return path


@pytest.fixture(scope="module")
def parts(folder, tmp_path_factory) -> dict[str, Path]:
    return comfy_qwen_image_files(folder, tmp_path_factory.mktemp("qwen-image-parts"))


@pytest.fixture(scope="module")
def carried_like(folder, tmp_path_factory) -> tuple[Path, Path]:
    return carried_like_with_tokenizers(folder, tmp_path_factory.mktemp("qwen-image-carried"), "Qwen-Image")


def _reference(folder: Path, transformer: dict | None = None, text_encoder: dict | None = None) -> torch.Tensor:
    """The folder's pipeline (no pack code) in bf16, holding the given weights (the text encoder's
    under the names its file holds)."""
    pipe = diffusers.QwenImagePipeline.from_pretrained(str(folder), dtype=BF16)
    if transformer is not None:
        pipe.transformer.load_state_dict(transformer, strict=True)
    if text_encoder is not None:  # (the saved names: ComfyUI's; the model's own: transformers')
        saved = {next(iter(comfy_text_encoder_state({k: t}))): k for k, t in pipe.text_encoder.state_dict().items()}
        pipe.text_encoder.load_state_dict({saved[k]: t for k, t in text_encoder.items()}, strict=True)
    return run_qwen_image(pipe)


@pytest.fixture(scope="module")
def expected(folder, denoiser) -> torch.Tensor:
    return _reference(folder, transformer=comfy_dequantised(denoiser, BF16))


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_comfyuis_files_run_with_the_carried_configs_in_every_placement(placement, folder, denoiser, parts,
                                                                        carried_like, expected):
    configs, package = carried_like
    before = {p: digest(p) for p in (denoiser, *parts.values())}
    assert carried.pick(denoiser, False, configs.parent) == configs
    pipe = load_pipeline_with_denoiser(configs, denoiser, BF16, comfy_tokenizers=package,
                                       text_encoder_file=parts["text_encoder"], vae_file=parts["vae"])
    attention = pipe.transformer.transformer_blocks[0].attn
    assert {attention.to_q.weight.dtype, attention.add_k_proj.weight.dtype} == {FP8}
    assert torch.equal(run_placed(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), run_qwen_image), expected)
    assert {p: digest(p) for p in before} == before


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_gguf_file_runs_with_the_carried_configs_as_diffusers_reads_it(placement, folder, parts, carried_like,
                                                                         tmp_path):
    """A Q8_0 GGUF file (city96's ``qwen-image-*.gguf`` kind: diffusers' names, architecture
    ``qwen_image``) written by the `gguf` package picks the carried folder and, placed, gives the
    bits of the folder's pipeline holding diffusers' own GGUF model of the file."""
    from diffusers import GGUFQuantizationConfig
    from diffusers.quantizers.gguf.utils import GGUFParameter
    from fixtures.gguf_files import write_gguf

    gguf = write_gguf({k: t.float() for k, t in transformer_state(folder).items()}, tmp_path / "qwen-image-Q8_0.gguf",
                      "Q8_0", "qwen_image")
    before = digest(gguf)
    configs, package = carried_like
    assert carried.pick(gguf, False, configs.parent) == configs
    transformer = diffusers.QwenImageTransformer2DModel.from_single_file(
        str(gguf), config=str(folder), subfolder="transformer", local_files_only=True,
        quantization_config=GGUFQuantizationConfig(compute_dtype=BF16))
    reference = run_qwen_image(diffusers.QwenImagePipeline.from_pretrained(str(folder), transformer=transformer,
                                                                          dtype=BF16))
    pipe = load_pipeline_with_denoiser(configs, gguf, BF16, comfy_tokenizers=package,
                                       text_encoder_file=parts["text_encoder"], vae_file=parts["vae"])
    assert any(isinstance(w, GGUFParameter) for w in pipe.transformer.parameters())  # kept packed
    assert torch.equal(run_placed(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), run_qwen_image), reference)
    assert digest(gguf) == before


def test_the_vae_in_wans_original_layout_is_the_folders_vae(folder, parts, tmp_path):
    """diffusers' own Wan 2.1 converter renames ``qwen_image_vae``'s keys: the folder's VAE bit for bit;
    a file in diffusers' names passes through it too; a Wan 2.2 VAE is refused by name."""
    want = diffusers.AutoencoderKLQwenImage.from_pretrained(str(folder / "vae")).state_dict()
    assert "decoder.upsamples.4.shortcut.weight" in load_file(str(parts["vae"]))
    for path in (parts["vae"], next((folder / "vae").glob("*.safetensors"))):
        got = load_vae(path, folder, BF16).state_dict()
        assert set(got) == set(want) and all(torch.equal(got[k], want[k].to(BF16)) for k in want)
    wan22 = tmp_path / "wan2.2_vae.safetensors"
    save_file({MARKER: torch.zeros(1)}, str(wan22))
    with pytest.raises(SingleFileError, match=r"wan2\.2_vae\.safetensors is a Wan 2\.2 VAE .*qwen_image_vae"):
        load_vae(wan22, folder, BF16)


def test_the_text_encoder_in_comfyuis_layout_with_or_without_its_vision_tower(folder, parts, tmp_path):
    """ComfyUI's layout is the folder's text encoder, tensor for tensor; a file without ``visual.*``
    (a text-to-image run never calls it) loads without the vision tower and encodes alike."""
    want = text_encoder_state(folder)
    model = load_text_encoder(parts["text_encoder"], folder / "text_encoder", TE, BF16)
    got = comfy_text_encoder_state(model.state_dict())
    assert set(got) == set(want) and all(torch.equal(got[k], want[k].to(BF16)) for k in want)
    text_only = tmp_path / "qwen_2.5_vl_text_only.safetensors"
    save_file({k: t for k, t in load_file(str(parts["text_encoder"])).items() if not k.startswith("visual.")},
              str(text_only))
    lean = load_text_encoder(text_only, folder / "text_encoder", TE, BF16)
    assert lean.model.visual is None
    ids = torch.tensor([[5, 9, 40, 7]])
    with torch.no_grad():
        assert torch.equal(lean(input_ids=ids, output_hidden_states=True).hidden_states[-1],
                           model(input_ids=ids, output_hidden_states=True).hidden_states[-1])


def test_an_fp8_scaled_text_encoder_keeps_its_fp8_layers(folder, parts, carried_like, tmp_path):
    """Comfy-Org's ``qwen_2.5_vl_7b_fp8_scaled`` kind of file: the language model's matrices in fp8
    with a ``scale_weight``. They stay fp8 in the pipeline, which gives the bits of the folder's
    pipeline whose text encoder holds them as ComfyUI computes them (``w.to(bf16) * scale``)."""
    stored, reference = {}, {}
    for key, t in text_encoder_state(folder).items():
        if t.ndim == 2 and key.startswith("model.layers."):
            scale = (t.float().abs().amax() / 448).reshape(())
            q = (t.float() / scale).to(FP8)
            stored |= {key: q, f"{key.removesuffix('.weight')}.scale_weight": scale}
            reference[key] = q.to(BF16) * scale.to(BF16)
        else:
            stored[key], reference[key] = t.to(BF16), t.to(BF16)
    te_file = tmp_path / "qwen_2.5_vl_tiny_fp8_scaled.safetensors"
    save_file({**comfy_text_encoder_state(stored), "scaled_fp8": torch.empty(0, dtype=FP8)}, str(te_file))
    want = _reference(folder, text_encoder=reference)
    configs, package = carried_like
    bf16 = carried_like[0].parent / "qwen_image_tiny_bf16.safetensors"
    save_file(comfy_tensors(transformer_state(folder), "bf16"), str(bf16))
    pipe = load_pipeline_with_denoiser(configs, bf16, BF16, comfy_tokenizers=package, text_encoder_file=te_file,
                                       vae_file=parts["vae"])
    layer = pipe.text_encoder.model.language_model.layers[0]
    assert {layer.mlp.up_proj.weight.dtype, layer.self_attn.q_proj.weight.dtype} == {FP8}
    assert torch.equal(run_placed(pipe, OffloadConfig(**PLACEMENTS["auto"], **BASE), run_qwen_image), want)



def test_a_qwen25_vl_gguf_text_encoder_keeps_its_packed_layers(folder, parts, carried_like, tmp_path):
    """llama.cpp's Qwen2.5-VL GGUF file (``qwen2vl``: the language model and head, written by the
    `gguf` package; the vision tower lives in another file) as the text encoder: its Linear layers
    keep the file's packed bytes, the model is built without the vision tower, and the pipeline gives
    the bits of the folder's pipeline whose text encoder holds the file's values; the file is left
    unchanged."""
    from diffusers.models.model_loading_utils import load_gguf_checkpoint
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor
    from fixtures.gguf_text_encoders import write_qwen3_gguf
    from gguf import MODEL_ARCH, get_tensor_name_map

    state = text_encoder_state(folder)
    te = write_qwen3_gguf(state, tmp_path / "Qwen2.5-VL-tiny-Q8_0.gguf", arch=MODEL_ARCH.QWEN2VL)
    before = digest(te)
    names = get_tensor_name_map(MODEL_ARCH.QWEN2VL, 2)
    saved = {names.get_name(k, try_suffixes=(".weight", ".bias")): k for k in state}
    values = {saved[k]: dequantize_gguf_tensor(v).to(BF16) for k, v in load_gguf_checkpoint(str(te)).items()}
    assert not any(k.startswith("visual.") for k in values) and "lm_head.weight" in values
    want = _reference(folder, text_encoder={**{k: t.to(BF16) for k, t in state.items()}, **values})
    configs, package = carried_like
    bf16 = configs.parent / "qwen_image_tiny_bf16.safetensors"
    save_file(comfy_tensors(transformer_state(folder), "bf16"), str(bf16))
    pipe = load_pipeline_with_denoiser(configs, bf16, BF16, comfy_tokenizers=package, text_encoder_file=te,
                                       vae_file=parts["vae"])
    packed = [n for n, w in pipe.text_encoder.named_parameters() if isinstance(w, GGUFParameter)]
    assert packed and all(n.endswith("proj.weight") or n == "lm_head.weight" for n in packed)
    assert pipe.text_encoder.model.visual is None
    assert torch.equal(run_placed(pipe, OffloadConfig(**PLACEMENTS["auto"], **BASE), run_qwen_image), want)
    assert digest(te) == before

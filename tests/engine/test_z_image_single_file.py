"""Z-Image single files in ComfyUI's layout (Comfy-Org's ``z_image_turbo`` files: q, k and v fused into
one ``qkv`` matrix) as the denoiser of a Z-Image diffusers folder, read through diffusers' own
single-file conversion: a bf16 file is the folder's
transformer bit for bit; an fp8_scaled one keeps its fp8 storage, each part of a fused ``qkv`` taking
the fused matrix's scale, and runs in every placement to the bits of the folder's pipeline holding
the file's weights as ComfyUI computes them (``w.to(bf16) * scale``), from a configs-only folder with
ComfyUI's text-encoder and VAE files too, and from the configs the pack carries (Z-Image Turbo's)
with ComfyUI's own tokenizer folder; a GGUF file (the community ones: the original names, as
ComfyUI-GGUF reads them) from the carried configs runs as diffusers' own GGUF model; the file is left
unchanged."""

from __future__ import annotations

from pathlib import Path

import diffusers
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats import carried
from diffusers_offload.offload_core.formats.fp8 import table_of
from diffusers_offload.offload_core.formats.inspect import inspect_safetensors
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from fixtures.comfy_files import carried_like_copy, comfy_dequantised, comfy_tensors, configs_only_copy
from fixtures.gguf_files import write_gguf
from fixtures.placements import PLACEMENTS, run_placed
from fixtures.quantized import digest
from fixtures.z_image_files import (
    CHAT,
    build_tiny_z_image,
    comfy_z_image_files,
    comfy_z_image_state,
    run_z_image,
)
from safetensors.torch import load_file, save_file

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
QKV = "layers.0.attention.qkv"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_z_image(tmp_path_factory.mktemp("z-image") / "z-image-tiny")


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("z-image-files")
    state = comfy_z_image_state(folder)
    for fmt in ("bf16", "fp8_scaled"):
        save_file(comfy_tensors(state, fmt), str(out / f"z_image_tiny_{fmt}.safetensors"))
    return {fmt: out / f"z_image_tiny_{fmt}.safetensors" for fmt in ("bf16", "fp8_scaled")}


@pytest.fixture(scope="module")
def expected(folder, files) -> torch.Tensor:
    """The folder's pipeline (no pack code) holding the fp8_scaled file's weights as ComfyUI computes them."""
    pipe = diffusers.ZImagePipeline.from_pretrained(str(folder), dtype=BF16)
    state = convert_z_image_transformer_checkpoint_to_diffusers(comfy_dequantised(files["fp8_scaled"], BF16))
    pipe.transformer.load_state_dict(state, strict=True)
    return run_z_image(pipe)


def test_a_bf16_file_is_the_folders_transformer(folder, files):
    info = inspect_safetensors(files["bf16"])
    assert (info.role, info.family) == ("denoiser", "z-image") and QKV + ".weight" in info.shapes
    model = load_denoiser(files["bf16"], folder, BF16)
    want = diffusers.ZImageTransformer2DModel.from_pretrained(str(folder), subfolder="transformer").state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_an_fp8_scaled_file_runs_as_comfyui_computes_it_in_every_placement(placement, folder, files, expected):
    before = digest(files["fp8_scaled"])
    pipe = load_pipeline_with_denoiser(folder, files["fp8_scaled"], BF16)
    attention, table = pipe.transformer.layers[0].attention, table_of(pipe.transformer)
    parts = [getattr(attention, f"to_{p}").weight for p in "qkv"]
    fused = float(load_file(str(files["fp8_scaled"]))[QKV + ".scale_weight"])
    assert all(w.dtype == FP8 for w in parts) and {table.exact[id(w)] for w in parts} == {fused}
    out = run_placed(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), run_z_image)
    assert torch.equal(out, expected)
    assert all(w.dtype == FP8 for w in parts)  # released: still stored
    assert digest(files["fp8_scaled"]) == before


def test_comfyuis_files_run_with_a_configs_only_folder(folder, files, expected, tmp_path):
    """What a ComfyUI user holds: the transformer file, the Qwen3 text encoder in ComfyUI's layout
    (``model.*``, as ComfyUI's ``qwen_3_4b`` file; transformers strips the base model's prefix) and
    the VAE file (the LDM layout of ``ae.safetensors``), with a folder of configs and tokenizer only:
    the same bits, streamed."""
    text_encoder = load_file(str(next((folder / "text_encoder").glob("*.safetensors"))))
    parts = comfy_z_image_files(folder, tmp_path / "files")
    configs = configs_only_copy(folder, tmp_path / "z-image-configs")
    pipe = load_pipeline_with_denoiser(configs, files["fp8_scaled"], BF16, text_encoder_file=parts["text_encoder"],
                                       vae_file=parts["vae"])
    assert all(torch.equal(pipe.text_encoder.state_dict()[k], t.to(BF16)) for k, t in text_encoder.items())
    assert torch.equal(run_placed(pipe, OffloadConfig(**PLACEMENTS["auto"], **BASE), run_z_image), expected)


def _carried_like(folder: Path, tmp: Path, template: str) -> tuple[Path, Path]:
    """The tiny Z-Image's configs standing for the carried folder, with the carried ``tokenizers.json``,
    and ComfyUI's ``comfy`` folder holding its tokenizer with chat template ``template``."""
    configs = carried_like_copy(folder, tmp / "carried" / "z-image-tiny")
    (configs / carried.SHIPPED).write_bytes((carried.by_name("Z-Image-Turbo") / carried.SHIPPED).read_bytes())
    package = tmp / "ComfyUI" / "comfy"
    tokenizer = diffusers.ZImagePipeline.from_pretrained(str(folder), transformer=None, vae=None,
                                                         text_encoder=None).tokenizer
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(package / "text_encoders" / "qwen25_tokenizer"))
    return configs, package


def test_comfyuis_files_run_with_the_configs_the_pack_carries_and_comfyuis_tokenizer(folder, files, expected,
                                                                                  tmp_path):
    """The carried Z-Image Turbo folder holds no tokenizer: its ``tokenizers.json`` names ComfyUI's
    ``qwen25_tokenizer`` folder, whose chat template (Qwen2.5's) adds a system prompt, and gives
    Qwen3's template, which Z-Image's prompts are read with. The tiny Z-Image's configs (with that
    file) stand for the carried folder, its tokenizer saved where ComfyUI keeps its own with a
    system-prompt template: the fp8_scaled file picks that folder and, with the Qwen3 file and the
    VAE in the LDM layout of ``ae.safetensors``, gives the folder's bits; without the carried
    template the prompt is read otherwise."""
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    configs, package = _carried_like(folder, tmp_path, system + CHAT)
    assert carried.pick(files["fp8_scaled"], False, configs.parent) == configs
    parts = comfy_z_image_files(folder, tmp_path / "files")
    parts = {"text_encoder_file": parts["text_encoder"], "vae_file": parts["vae"]}

    def run() -> torch.Tensor:
        pipe = load_pipeline_with_denoiser(configs, files["fp8_scaled"], BF16, comfy_tokenizers=package, **parts)
        return run_placed(pipe, OffloadConfig(**PLACEMENTS["auto"], **BASE), run_z_image)

    assert torch.equal(run(), expected)
    (configs / carried.SHIPPED).write_bytes((carried.by_name("MiniMax-H3") / carried.SHIPPED).read_bytes())
    assert not torch.equal(run(), expected)  # the same folder, ComfyUI's own template


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_gguf_file_runs_with_the_carried_configs_as_diffusers_reads_it(placement, folder, tmp_path):
    """A Q8_0 GGUF file written by the `gguf` package in the original key names picks the carried
    folder; with ComfyUI's Qwen3 and VAE files, placed, it gives the bits of the folder's pipeline
    holding diffusers' own GGUF model of the file."""
    from diffusers import GGUFQuantizationConfig
    from diffusers.quantizers.gguf.utils import GGUFParameter

    gguf = write_gguf({k: t.float() for k, t in comfy_z_image_state(folder).items()}, tmp_path / "z-image-Q8_0.gguf",
                      "Q8_0", "lumina2")
    before = digest(gguf)
    configs, package = _carried_like(folder, tmp_path, CHAT)
    assert carried.pick(gguf, False, configs.parent) == configs
    transformer = diffusers.ZImageTransformer2DModel.from_single_file(
        str(gguf), config=str(folder), subfolder="transformer", local_files_only=True,
        quantization_config=GGUFQuantizationConfig(compute_dtype=BF16))
    reference = run_z_image(diffusers.ZImagePipeline.from_pretrained(str(folder), transformer=transformer, dtype=BF16))
    parts = comfy_z_image_files(folder, tmp_path / "files")
    pipe = load_pipeline_with_denoiser(configs, gguf, BF16, comfy_tokenizers=package,
                                       text_encoder_file=parts["text_encoder"], vae_file=parts["vae"])
    assert any(isinstance(w, GGUFParameter) for w in pipe.transformer.parameters())  # kept packed
    assert torch.equal(run_placed(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), run_z_image), reference)
    assert digest(gguf) == before


def test_a_qwen3_fp8_mixed_text_encoder_keeps_its_fp8_layers(folder, files, tmp_path):
    """Comfy-Org's ``qwen_3_4b_fp8_mixed`` kind of file: some matrices in fp8 with a ``weight_scale``
    and a ``comfy_quant`` entry, the rest bf16, in ComfyUI's ``model.*`` layout. Those matrices stay
    fp8 in the pipeline, which gives the bits of the folder's pipeline whose text encoder holds them
    as ComfyUI computes them (``w.to(bf16) * scale``); the file is left unchanged."""
    text_encoder = load_file(str(next((folder / "text_encoder").glob("*.safetensors"))))
    stored, reference = {}, {}
    for key, t in text_encoder.items():
        if t.ndim == 2 and ".mlp." in key:  # mixed: the feed-forward matrices in fp8
            scale = (t.abs().amax().float() / 448).reshape(())
            q = (t.float() / scale).to(FP8)
            layer = f"model.{key.removesuffix('.weight')}"
            stored |= {f"model.{key}": q, f"{layer}.weight_scale": scale,
                       f"{layer}.comfy_quant": torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)}
            reference[key] = q.to(BF16) * scale.to(BF16)
        else:
            stored[f"model.{key}"], reference[key] = t.to(BF16), t.to(BF16)
    te_file = tmp_path / "qwen_3_tiny_fp8_mixed.safetensors"
    save_file(stored, str(te_file))
    before = digest(te_file)
    pipe = diffusers.ZImagePipeline.from_pretrained(str(folder), dtype=BF16)
    pipe.text_encoder.load_state_dict(reference, strict=True)
    want = run_z_image(pipe)
    ours = load_pipeline_with_denoiser(configs_only_copy(folder, tmp_path / "configs"), files["bf16"], BF16,
                                       text_encoder_file=te_file, vae_file=next((folder / "vae").glob("*.safetensors")))
    mlp = ours.text_encoder.layers[0].mlp
    assert {mlp.up_proj.weight.dtype, mlp.down_proj.weight.dtype} == {FP8}
    assert ours.text_encoder.layers[0].self_attn.q_proj.weight.dtype == BF16
    assert torch.equal(run_placed(ours, OffloadConfig(**PLACEMENTS["auto"], **BASE), run_z_image), want)
    assert digest(te_file) == before


def test_a_qwen3_gguf_text_encoder_keeps_its_packed_layers(folder, files, tmp_path):
    """A Qwen3 GGUF file (llama.cpp's names, written by the `gguf` package; what Z-Image users pick in
    place of ``qwen_3_4b``) as the text encoder: its Linear layers keep the file's packed bytes
    (diffusers' GGUFLinear), and the pipeline gives the bits of the folder's pipeline whose text
    encoder holds the file's values as diffusers' GGUF layers compute with them; the file is left
    unchanged. A Qwen3 file for a T5 text encoder is refused by name."""
    from diffusers.models.model_loading_utils import load_gguf_checkpoint
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor
    from diffusers_offload.offload_core.formats.gguf_text_encoder import load_gguf_text_encoder
    from diffusers_offload.offload_core.formats.inspect import SingleFileError
    from fixtures.gguf_text_encoders import write_qwen3_gguf
    from gguf import MODEL_ARCH, get_tensor_name_map

    state = load_file(str(next((folder / "text_encoder").glob("*.safetensors"))))
    te = write_qwen3_gguf({f"model.{k}": t for k, t in state.items()}, tmp_path / "qwen3-tiny-Q8_0.gguf")
    before = digest(te)
    pipe = diffusers.ZImagePipeline.from_pretrained(str(folder), dtype=BF16)
    names = get_tensor_name_map(MODEL_ARCH.QWEN3, pipe.text_encoder.config.num_hidden_layers)
    ours = {names.get_name(k, try_suffixes=(".weight",)): k for k in pipe.text_encoder.state_dict()}
    pipe.text_encoder.load_state_dict({ours[k]: dequantize_gguf_tensor(v).to(BF16)
                                       for k, v in load_gguf_checkpoint(str(te)).items()}, strict=True)
    want = run_z_image(pipe)
    gguf_pipe = load_pipeline_with_denoiser(configs_only_copy(folder, tmp_path / "configs"), files["bf16"], BF16,
                                            text_encoder_file=te, vae_file=next((folder / "vae").glob("*.safetensors")))
    packed = [n for n, w in gguf_pipe.text_encoder.named_parameters() if isinstance(w, GGUFParameter)]
    assert packed and all(n.endswith("proj.weight") for n in packed)
    assert torch.equal(run_placed(gguf_pipe, OffloadConfig(**PLACEMENTS["auto"], **BASE), run_z_image), want)
    assert digest(te) == before
    with pytest.raises(SingleFileError, match=r"is a Qwen3 text encoder \(GGUF\), but the text encoder of .* is a "
                                              r"UMT5EncoderModel"):
        load_gguf_text_encoder(te, folder / "text_encoder", "UMT5EncoderModel", BF16)

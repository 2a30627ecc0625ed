"""The configs the pack carries (Wan 2.1 / 2.2, FLUX.1 and Kontext, LTX-2, Z-Image Turbo, Qwen-Image (its own file), MiniMax-H3), so single files run without a diffusers folder:
each carried folder builds the released models' sizes through the real classes and is what
``tools/write_carried_configs.py`` writes; a denoiser file picks the folder of its shape (and
second expert); the tokenizer is read from the text-encoder file's sentencepiece model, and a
pipeline from carried configs runs as the one from a full configs folder."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import diffusers
import pytest
import torch
import transformers
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats import carried
from diffusers_offload.offload_core.formats.inspect import SingleFileError, describe_keys
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from fixtures import comfy_files
from fixtures.carried_checks import billions, meta_model, pipeline_index
from fixtures.comfy_files import carried_like_copy, write_comfy_wan, write_fp8_text_encoder
from fixtures.flux_files import bfl_flux_state
from fixtures.gguf_files import comfy_wan_shapes
from fixtures.gguf_text_encoders import t5_state, write_t5_gguf
from fixtures.placements import run_placed
from fixtures.tiny_tok import tiny_t5_spiece, tiny_t5_tokenizer
from fixtures.z_image_files import RENAMES as Z_IMAGE_RENAMES

ROOT = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16
CONFIG = OffloadConfig(mode="auto", on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
_FIXTURES = (comfy_files.comfy_wan, comfy_files.wan_configs_only, comfy_files.wan_component_files)
_comfy_wan, _configs_only, _component_files = _FIXTURES
# parameters of the released models, in billions (their bf16 / fp16 files' bytes / 2)
RELEASED = {"Wan2.1-T2V-1.3B-Diffusers": 1.419, "Wan2.1-T2V-14B-Diffusers": 14.29, "Wan2.1-I2V-14B-480P-Diffusers": 16.40,
            "Wan2.2-T2V-A14B-Diffusers": 14.29, "Wan2.2-I2V-A14B-Diffusers": 14.29, "Wan2.2-TI2V-5B-Diffusers": 5.000}
VAE = {False: 0.127, True: 0.705}  # wan_2.1_vae, wan2.2_vae (48 latent channels)
UMT5_XXL_ENCODER, CLIP_VISION_H = 5.68, 0.632
FLUX_TRANSFORMER, FLUX_VAE, CLIP_L_TEXT, T5_XXL_ENCODER = 11.90, 0.0838, 0.1231, 4.762
Z_IMAGE_TRANSFORMER, QWEN3_4B = 6.1549, 4.0225  # z_image_turbo_bf16, qwen_3_4b (no head)
TINY = ("wan", "wan_i2v", "wan22_ti2v", "wan22_a14b", "wan22_a14b_i2v")
WAN = [f for f in carried.carried() if f.name.startswith("Wan")]
FLUX = [f for f in carried.carried() if f.name.startswith("FLUX.1")]


def test_the_pack_carries_wan_and_flux_configs() -> None:
    assert len(WAN) == 6 and [f.name for f in FLUX] == ["FLUX.1-Kontext-dev", "FLUX.1-dev", "FLUX.1-schnell"]


@pytest.mark.parametrize("folder", WAN, ids=lambda p: p.name)
def test_each_carried_wan_folder_builds_the_released_model_sizes(folder: Path) -> None:
    index = pipeline_index(folder)
    for name in ("transformer", "transformer_2") if (folder / "transformer_2").is_dir() else ("transformer",):
        assert billions(meta_model(diffusers.WanTransformer3DModel, folder / name)) == pytest.approx(
            RELEASED[folder.name], rel=5e-3)
    vae = meta_model(diffusers.AutoencoderKLWan, folder / "vae")
    assert billions(vae) == pytest.approx(VAE[vae.config.z_dim == 48], rel=5e-3)
    assert billions(meta_model(transformers.UMT5EncoderModel, folder / "text_encoder")) == pytest.approx(
        UMT5_XXL_ENCODER, rel=5e-3)
    if index.get("image_encoder", [None])[0]:
        image = meta_model(transformers.CLIPVisionModelWithProjection, folder / "image_encoder")
        assert billions(image) == pytest.approx(CLIP_VISION_H, rel=5e-3)
        assert transformers.CLIPImageProcessor.from_pretrained(str(folder / "image_processor")).crop_size == {
            "height": 224, "width": 224}
    scheduler = diffusers.UniPCMultistepScheduler.from_pretrained(str(folder / "scheduler"))
    assert scheduler.config.flow_shift == (5.0 if "TI2V" in folder.name else 3.0)


@pytest.mark.parametrize("folder", FLUX, ids=lambda p: p.name)
def test_each_carried_flux_folder_builds_the_released_model_sizes(folder: Path) -> None:
    """FLUX.1 dev / schnell / Kontext dev: the same sizes, dev and Kontext with a guidance input and
    a dynamic-shift scheduler, Kontext under its own pipeline; the tokenizers are ComfyUI's (CLIP-L at
    77 tokens, T5 at 512, as the released folders)."""
    index = pipeline_index(folder)
    dev = "schnell" not in folder.name
    assert index["_class_name"] == ("FluxKontextPipeline" if "Kontext" in folder.name else "FluxPipeline")
    transformer = meta_model(diffusers.FluxTransformer2DModel, folder / "transformer")
    assert billions(transformer) == pytest.approx(FLUX_TRANSFORMER, rel=5e-3) and transformer.config.guidance_embeds == dev
    assert billions(meta_model(diffusers.AutoencoderKL, folder / "vae")) == pytest.approx(FLUX_VAE, rel=5e-3)
    assert billions(meta_model(transformers.CLIPTextModel, folder / "text_encoder")) == pytest.approx(CLIP_L_TEXT, rel=5e-3)
    assert billions(meta_model(transformers.T5EncoderModel, folder / "text_encoder_2")) == pytest.approx(
        T5_XXL_ENCODER, rel=5e-3)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder / "scheduler"))
    assert (scheduler.config.use_dynamic_shifting, scheduler.config.shift) == ((True, 3.0) if dev else (False, 1.0))
    assert json.loads((folder / "tokenizers.json").read_text()) == {
        "tokenizer": {"comfyui": "sd1_tokenizer", "model_max_length": 77},
        "tokenizer_2": {"comfyui": "text_encoders/t5_tokenizer", "model_max_length": 512}}


def test_the_carried_z_image_folder_builds_the_released_model_sizes() -> None:
    """Z-Image Turbo: its transformer, Qwen3-4B without a head (ComfyUI's ``qwen_3_4b`` file), the FLUX.1
    VAE; a fixed shift of 3; the tokenizer ComfyUI's Qwen folder with Qwen3's chat template."""
    folder = carried.by_name("Z-Image-Turbo")
    pipeline_index(folder)
    assert billions(meta_model(diffusers.ZImageTransformer2DModel, folder / "transformer")) == pytest.approx(
        Z_IMAGE_TRANSFORMER, rel=5e-3)
    assert billions(meta_model(transformers.Qwen3Model, folder / "text_encoder")) == pytest.approx(QWEN3_4B, rel=5e-3)
    assert billions(meta_model(diffusers.AutoencoderKL, folder / "vae")) == pytest.approx(FLUX_VAE, rel=5e-3)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder / "scheduler"))
    assert (scheduler.config.use_dynamic_shifting, scheduler.config.shift) == (False, 3.0)
    tokenizers = json.loads((folder / "tokenizers.json").read_text())
    assert set(tokenizers) == {"tokenizer"} and tokenizers["tokenizer"]["comfyui"] == "text_encoders/qwen25_tokenizer"


def test_the_released_z_image_shape_picks_its_folder() -> None:
    """A Z-Image Turbo file (the model's original key names, q, k and v fused, as Comfy-Org's files
    hold it) picks the carried folder; a file of another depth fits none and is told by its shape."""
    folder = carried.by_name("Z-Image-Turbo")
    shapes = {}
    for key, tensor in meta_model(diffusers.ZImageTransformer2DModel, folder / "transformer").state_dict().items():
        for new, old in Z_IMAGE_RENAMES:
            key = key.replace(new, old)
        shapes[key] = tuple(tensor.shape)
    for q in [k for k in shapes if k.endswith(".attention.to_q.weight")]:
        rows, cols = shapes.pop(q)
        shapes[q.replace(".to_q.", ".qkv.")] = (rows * 3, cols)
        del shapes[q.replace(".to_q.", ".to_k.")], shapes[q.replace(".to_q.", ".to_v.")]
    info = describe_keys(Path("z_image_turbo_bf16.safetensors"), shapes)
    assert info.family == "z-image" and carried.choose(info, False, carried.carried()) == folder
    shallow = {k: v for k, v in shapes.items() if not k.startswith("layers.29.")}
    with pytest.raises(SingleFileError, match="z-image denoiser of 29 blocks of width 3840 .2 refiner blocks."):
        carried.choose(describe_keys(Path("z_image_pruned.safetensors"), shallow), False, carried.carried())


# MiniMax-H3 as Comfy-Org's files hold it, in billions (the bf16 / fp16 files' bytes / 2, the fp32 audio VAE's / 4):
# minimax_h3_fl2va_bf16, qwen3vl_32b_minimax_h3_bf16 (50 layers, no head, no final norm), minimax_h3_video_vae_fp16,
# minimax_h3_audio_vae_fp32 (its weight-norm convolutions folded)
H3 = {"transformer": 33.140, "conditioner": 25.753, "vae": 2.6039, "audio_vae": 0.15131}


def test_the_carried_h3_folder_builds_the_released_model_sizes() -> None:
    """MiniMax-H3: each model at the size of ComfyUI's file of it, the conditioner trimmed as the
    loader trims it; Qwen3-VL-32B's RoPE base; the schedulers' shifts; Qwen3-VL's processors at
    16 px patches; the index points nowhere (the loader supplies every model and the tokenizer)."""
    from diffusers_offload.offload_core.models.minimax_h3.conditioner import fit_conditioner

    folder = carried.by_name("MiniMax-H3")
    assert carried.carried_modular() == [folder] and not any(folder.rglob("*.safetensors"))
    transformer = meta_model(diffusers.MiniMaxH3Transformer3DModel, folder / "transformer")
    assert billions(transformer) == pytest.approx(H3["transformer"], rel=5e-3)
    assert transformer.config == meta_model(diffusers.MiniMaxH3Transformer3DModel, folder / "transformer_ref").config
    encoder = meta_model(transformers.Qwen3VLForConditionalGeneration, folder / "text_encoder")
    assert encoder.config.text_config.rope_parameters["rope_theta"] == 5e6
    fit_conditioner(encoder, 50)
    kept = billions(encoder) - billions(encoder.lm_head) - billions(encoder.model.language_model.norm)
    assert kept == pytest.approx(H3["conditioner"], rel=5e-3)
    assert billions(meta_model(diffusers.AutoencoderKLMiniMaxH3, folder / "vae")) == pytest.approx(H3["vae"], rel=5e-3)
    audio = meta_model(diffusers.AutoencoderKLMiniMaxH3Audio, folder / "audio_vae")
    assert billions(audio) == pytest.approx(H3["audio_vae"], rel=5e-3) and audio.config.latents_mean is None
    shifts = [diffusers.MiniMaxH3Scheduler.from_pretrained(str(folder / n)).config.shift
              for n in ("scheduler", "audio_scheduler")]
    assert shifts == [12.0, 3.0]
    pixels = transformers.AutoImageProcessor.from_pretrained(str(folder / "processor"))
    assert (pixels.patch_size, pixels.merge_size, list(pixels.image_mean)) == (16, 2, [0.5] * 3)
    index = json.loads((folder / "modular_model_index.json").read_text())
    specs = {k: v for k, v in index.items() if isinstance(v, list)}
    assert {v[2]["pretrained_model_name_or_path"] for v in specs.values()} == {None}
    assert json.loads((folder / "tokenizers.json").read_text()) == {"tokenizer": {"comfyui": "text_encoders/qwen25_tokenizer"}}


def test_the_carried_folders_are_what_the_tool_writes(tmp_path: Path, monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("write_carried_configs", ROOT / "tools" / "write_carried_configs.py")
    tool = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, tool)  # (its dataclasses look their module up)
    spec.loader.exec_module(tool)
    tool.main(tmp_path / "out")
    versions = ("_diffusers_version", "transformers_version")

    def files(root: Path) -> dict[str, dict]:
        return {p.relative_to(root).as_posix(): {k: v for k, v in json.loads(p.read_text()).items() if k not in versions}
                for p in sorted(root.rglob("*.json"))}

    assert files(tmp_path / "out") == files(carried.ROOT)


@pytest.mark.parametrize("folder", FLUX, ids=lambda p: p.name)
def test_each_released_flux_shape_picks_its_own_folder(folder: Path) -> None:
    """A FLUX.1 file (BFL's key names) picks dev or schnell by its guidance input, Kontext dev by its
    name (BFL's ``flux1-kontext-dev``, Comfy-Org's ``flux1-dev-kontext_fp8_scaled``); Fill's 384 input
    channels fit none."""
    model = meta_model(diffusers.FluxTransformer2DModel, folder / "transformer")
    info = describe_keys(Path(f"{folder.name}.safetensors"), {k: tuple(v.shape) for k, v in bfl_flux_state(model).items()})
    assert info.family == "flux" and carried.choose(info, False, carried.carried()) == folder
    if "Kontext" in folder.name:
        for name in ("flux1-kontext-dev.safetensors", "flux1-dev-kontext_fp8_scaled.safetensors"):
            assert carried.choose(describe_keys(Path(name), info.shapes), False, carried.carried()) == folder
    fill = dict(info.shapes, **{"img_in.weight": (3072, 384)})
    with pytest.raises(SingleFileError, match="flux denoiser of 19 double and 38 single blocks .* 384 input channels"):
        carried.choose(describe_keys(Path("flux1-fill-dev.safetensors"), fill), False, carried.carried())


def test_a_flux_file_with_packed_input_layers_picks_its_folder_by_their_width() -> None:
    """Layers stored two weights a byte (NVFP4, W4A8: half the stored columns) are read at their
    width: FLUX.1 dev's input layers so stored still pick dev."""
    folder = carried.by_name("FLUX.1-dev")
    model = meta_model(diffusers.FluxTransformer2DModel, folder / "transformer")
    shapes = {k: tuple(v.shape) for k, v in bfl_flux_state(model).items()}
    packed = ("img_in", "txt_in", "vector_in.in_layer")
    for layer in packed:
        rows, cols = shapes[f"{layer}.weight"]
        shapes[f"{layer}.weight"] = (rows, cols // 2)
    info = describe_keys(Path("flux1-dev-nvfp4.safetensors"), shapes)
    with pytest.raises(SingleFileError, match="none of the configs the pack carries"):
        carried.choose(info, False, carried.carried())  # undeclared, the halved widths fit no folder
    info.metadata["_quantization_metadata"] = json.dumps({"layers": {k: {"format": "nvfp4"} for k in packed}})
    assert carried.choose(info, False, carried.carried()) == folder


@pytest.mark.parametrize("folder", WAN, ids=lambda p: p.name)
def test_each_released_wan_shape_picks_its_own_folder(folder: Path) -> None:
    """A file holding the released model's tensors (its header: the shapes of the model built on
    the meta device, under ComfyUI's key names) picks its folder; A14B's experts need both files."""
    shapes = comfy_wan_shapes(meta_model(diffusers.WanTransformer3DModel, folder / "transformer"))
    info = describe_keys(Path(f"{folder.name}.safetensors"), shapes)
    two = (folder / "transformer_2").is_dir()
    assert carried.choose(info, two, carried.carried()) == folder
    if folder.name == "Wan2.2-T2V-A14B-Diffusers":  # one expert alone: the Wan 2.1 T2V 14B shape
        assert carried.choose(info, False, carried.carried()).name == "Wan2.1-T2V-14B-Diffusers"
    elif two:
        with pytest.raises(SingleFileError, match="low-noise one in denoiser_2"):
            carried.choose(info, False, carried.carried())
    elif folder.name != "Wan2.1-T2V-14B-Diffusers":
        with pytest.raises(SingleFileError, match="none of the configs the pack carries.*leave denoiser_2"):
            carried.choose(info, True, carried.carried())


@pytest.mark.parametrize(("base", "key", "what"), [
    ("Wan2.1-I2V-14B-480P-Diffusers", "img_emb.emb_pos", "with frame positions \\(FLF2V\\)"),
    ("Wan2.1-T2V-14B-Diffusers", "vace_blocks.0.after_proj.bias", "VACE blocks"),
    ("Wan2.1-T2V-14B-Diffusers", "motion_encoder.dec.direction.weight", "Animate blocks")])
def test_wan_variants_the_pack_carries_no_config_for_fit_none(base: str, key: str, what: str) -> None:
    """Wan 2.1 FLF2V (frame positions in the image embedding), VACE and Wan 2.2 Animate share a
    carried model's blocks but not its modules: refused, saying what the file has, not misloaded."""
    shapes = comfy_wan_shapes(meta_model(diffusers.WanTransformer3DModel, carried.by_name(base) / "transformer"))
    info = describe_keys(Path("wan-variant.safetensors"), {**shapes, key: (1, 2)})
    with pytest.raises(SingleFileError, match=f"{what}: none of the configs the pack carries"):
        carried.choose(info, False, carried.carried())


@pytest.fixture(scope="module")
def tiny_carried(tiny_wan_dir, tiny_wan_family, tmp_path_factory) -> dict[str, Path]:
    """A tiny stand-in for the pack's carried configs: each tiny Wan family folder less its weights
    and tokenizer, as the carried folders are, under one root."""
    root = tmp_path_factory.mktemp("carried")
    out = {}
    for family in TINY:
        source = tiny_wan_dir if family == "wan" else tiny_wan_family(family)
        out[family] = carried_like_copy(source, root / family)
    return out


def test_tiny_files_pick_their_tiny_carried_folder(tiny_carried, tiny_wan_dir, tiny_wan_family, tmp_path) -> None:
    for family in TINY:
        source = tiny_wan_dir if family == "wan" else tiny_wan_family(family)
        file = write_comfy_wan(source, tmp_path / f"{family}.safetensors", "fp8_scaled")
        two = "a14b" in family
        assert carried.pick(file, two, tiny_carried["wan"].parent) == tiny_carried[family], family


def test_a_pipeline_from_carried_configs_runs_as_one_from_a_configs_folder(
        tiny_carried, comfy_wan, wan_configs_only, wan_component_files, tmp_path, caplog) -> None:
    te = write_fp8_text_encoder(wan_component_files["text_encoder"], tmp_path / "umt5-fp8_scaled.safetensors",
                                scaled=True, spiece=tiny_t5_spiece())
    denoiser, vae = comfy_wan("fp8_scaled"), wan_component_files["vae"]
    with caplog.at_level("INFO", logger="diffusers_offload"):
        folder = carried.pick(denoiser, False, tiny_carried["wan"].parent)
        pipe = load_pipeline_with_denoiser(folder, denoiser, BF16, te, vae)
    assert "tokenizer read from its sentencepiece model" in caplog.text
    _runs_as_the_configs_folder_pipeline(pipe, load_pipeline_with_denoiser(wan_configs_only, denoiser, BF16, te, vae))


def test_a_gguf_text_encoder_gives_the_tokenizer_from_its_metadata(
        tiny_carried, comfy_wan, wan_configs_only, wan_component_files, tmp_path) -> None:
    """city96's UMT5 GGUFs carry llama.cpp's tokenizer metadata (no spiece_model entry): the
    sentencepiece model is rebuilt from it, as ComfyUI-GGUF does; without it, refused by name."""
    state, vae = t5_state(wan_component_files["text_encoder"]), wan_component_files["vae"]
    te = write_t5_gguf(state, tmp_path / "umt5-tiny-encoder-Q8_0.gguf", spiece=tiny_t5_spiece())
    pipe = load_pipeline_with_denoiser(tiny_carried["wan"], comfy_wan("fp8"), BF16, te, vae)
    _runs_as_the_configs_folder_pipeline(pipe, load_pipeline_with_denoiser(wan_configs_only, comfy_wan("fp8"), BF16,
                                                                           te, vae))
    bare = write_t5_gguf(state, tmp_path / "umt5-tiny-bare-Q8_0.gguf")
    with pytest.raises(SingleFileError, match=f"{bare.name} carries none .*no T5 tokenizer metadata"):
        load_pipeline_with_denoiser(tiny_carried["wan"], comfy_wan("fp8"), BF16, bare, vae)


def _runs_as_the_configs_folder_pipeline(pipe, reference) -> None:
    """``pipe`` (carried configs, the tokenizer from the text-encoder file) tokenizes as the tiny
    folder's tokenizer and runs, placed, to the bits of ``reference`` (the configs folder's)."""
    for prompt in ("a red fox, jumping!", "Two cats at night 42", "  spaced   out  "):
        assert pipe.tokenizer(prompt).input_ids == tiny_t5_tokenizer()(prompt).input_ids
    for p in (pipe, reference):
        p.set_progress_bar_config(disable=True)
    assert torch.equal(run_placed(pipe, CONFIG), run_placed(reference, CONFIG))


def test_a_text_encoder_file_without_a_tokenizer_is_refused_by_name(tiny_carried, comfy_wan, wan_component_files):
    te = wan_component_files["text_encoder"]
    with pytest.raises(SingleFileError, match=f"{te.name} carries none \\(no spiece_model or tekken_model entry"):
        load_pipeline_with_denoiser(tiny_carried["wan"], comfy_wan("fp8"), BF16, te, wan_component_files["vae"])


def test_a_file_of_another_family_or_role_is_refused(wan_component_files) -> None:
    with pytest.raises(SingleFileError, match="looks like .*text encoder.*configs for Wan 2.1 / 2.2, FLUX.1, FLUX.2, LTX-2, Z-Image Turbo, Qwen-Image and Qwen-Image-Edit only"):
        carried.pick(wan_component_files["text_encoder"], False)
    with pytest.raises(SingleFileError, match="carries no config folder 'Wan9'.*Wan2.1-T2V-14B-Diffusers"):
        carried.by_name("Wan9")


def test_a_pruned_h3_file_is_refused_naming_the_unpruned_one(tiny_h3_dir, tmp_path) -> None:
    """Comfy-Org's ``minimax_h3_*_pruned_*`` files replace the time embedder with a table (curve AdaLN)
    that diffusers' H3 class has no form for: refused by name, pointing at the unpruned file."""
    from diffusers_offload.offload_core.formats.single_file import load_denoiser
    from fixtures.h3_files import comfy_h3_state_dict, write

    model = diffusers.MiniMaxH3Transformer3DModel.from_pretrained(str(tiny_h3_dir / "transformer"))
    state = {k: v for k, v in comfy_h3_state_dict(model.state_dict(), dict(model.config)).items()
             if not k.startswith("time_embedder.")}
    path = write({**state, "adaln_t_table": torch.zeros(64, 8)}, tmp_path / "minimax_h3_fl2va_pruned_bf16.safetensors")
    with pytest.raises(SingleFileError, match=r"minimax_h3_fl2va_pruned_bf16\.safetensors.*pruned MiniMax-H3 .*unpruned"):
        load_denoiser(path, tiny_h3_dir, torch.float32)

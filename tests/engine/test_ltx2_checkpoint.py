"""ComfyUI's all-in-one LTX-2 checkpoint (``models/checkpoints/ltx-2-19b-*.safetensors``: the
transformer with both text connectors under ``model.diffusion_model.``, the text projection, the
video VAE, audio VAE and vocoder beside it, in LTX-2's original key names) as the single-file
denoiser: every one of those models comes from the file, the config folder gives configs (and here
the text encoder), and the run equals the diffusers folder's bit for bit. The tiny LTX-2's VAE has
LTX-2's block structure (`fixtures.ltx2_files`: each part checked to convert back with diffusers'
converters and the conversion script's tables)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from diffusers import LTX2Pipeline
from diffusers_offload.offload_core.formats import carried
from diffusers_offload.offload_core.formats.checkpoint_parts import PARTS, parts_in
from diffusers_offload.offload_core.formats.inspect import SingleFileError, inspect_safetensors
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from fixtures.comfy_files import configs_only_copy
from fixtures.ltx2_files import CHECKPOINTABLE_SIZE, build_tiny_ltx2_checkpointable, write_ltx2_checkpoint
from fixtures.quantized import digest
from fixtures.tiny_models import run_ltx2
from safetensors.torch import load_file, save_file

HELD = ["connectors", "vae", "audio_vae", "vocoder"]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(the tiny LTX-2 folder, its pipeline's run, its checkpoint file, a copy of the folder whose
    only weights are the text encoder's)"""
    tmp = tmp_path_factory.mktemp("ltx2-checkpoint")
    folder = build_tiny_ltx2_checkpointable(tmp / "tiny-ltx2")
    pipe = LTX2Pipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    reference = run_ltx2(pipe, **CHECKPOINTABLE_SIZE)
    path = write_ltx2_checkpoint(pipe, tmp / "ltx-2-tiny-dev.safetensors")
    configs = configs_only_copy(folder, tmp / "configs")
    shutil.copytree(folder / "text_encoder", configs / "text_encoder", dirs_exist_ok=True)
    return folder, reference, path, configs


def test_the_checkpoint_is_an_ltx2_denoiser_holding_its_other_models(case):
    _folder, _reference, path, _configs = case
    info = inspect_safetensors(path)
    assert (info.family, info.role) == ("ltx2", "denoiser")  # not "a VAE" (its vae.* keys), not LTX-Video
    assert parts_in(info) == HELD


def test_a_pipeline_around_the_checkpoint_runs_as_the_folders(case):
    _folder, reference, path, configs = case
    before = digest(path)
    pipe = load_pipeline_with_denoiser(configs, path, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    out = run_ltx2(pipe, **CHECKPOINTABLE_SIZE)
    torch.testing.assert_close(out.video, reference.video, rtol=0, atol=0)
    torch.testing.assert_close(out.audio, reference.audio, rtol=0, atol=0)
    assert digest(path) == before


def test_the_checkpoints_models_are_used_over_the_folders(case):
    """With a folder holding every weight, the checkpoint's VAE is still the one that decodes."""
    folder, reference, path, _configs = case
    state = load_file(str(path))
    moved = next(k for k in state if k.startswith("vae.decoder.") and k.endswith(".bias"))
    state[moved] = state[moved] + 0.5
    other = path.with_name("ltx-2-tiny-moved.safetensors")
    save_file(state, str(other))
    pipe = load_pipeline_with_denoiser(folder, other, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert not torch.equal(run_ltx2(pipe, **CHECKPOINTABLE_SIZE).video, reference.video)


def test_a_checkpoint_part_that_does_not_fit_is_refused_by_name(case, tmp_path):
    _folder, _reference, path, configs = case
    state = {k: v for k, v in load_file(str(path)).items() if not k.startswith("vocoder.conv_post.")}
    short = tmp_path / "ltx-2-short.safetensors"
    save_file(state, str(short))
    with pytest.raises(SingleFileError, match=r"ltx-2-short\.safetensors: its vocoder does not fit LTX2Vocoder .*conv_out"):
        load_pipeline_with_denoiser(configs, short, torch.float32)


def _quantized_parts(state: dict[str, torch.Tensor], fmt: str) -> tuple[dict, dict]:
    """(the checkpoint with its parts' matrices quantized, the same with those decoded as ComfyUI
    decodes them, in float32): ``int8_convrot``: comfy-kitchen's convrot int8 where group 4 divides
    the width, per-row int8 elsewhere (its dequantisation); ``fp8_scaled``: every part matrix and
    convolution in fp8 with a ``scale_weight`` (``w.to(dtype) * scale``); the denoiser as it is."""
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    from fixtures.comfy_files import FP8, FP8_MAX, int8_tensors

    part = tuple(p for prefixes in PARTS["ltx2"].values() for p in prefixes)
    matrices = {k: v for k, v in state.items() if k.startswith(part) and k.endswith(".weight") and v.ndim >= 2}
    dense, quantized = dict(state), dict(state)
    if fmt == "fp8_scaled":
        quantized["scaled_fp8"] = torch.empty(0, dtype=FP8)
        for key, w in matrices.items():
            scale = (w.abs().amax() / FP8_MAX).clamp_min(1e-12).reshape(())
            quantized[key] = (w / scale).to(FP8)
            quantized[key.removesuffix("weight") + "scale_weight"] = scale
            dense[key] = quantized[key].float() * scale
        return quantized, dense
    q, _header = int8_tensors({k: v for k, v in matrices.items() if v.ndim == 2}, per_row=True, convrot=4)
    quantized |= q
    for key in [k for k in q if k.endswith(".weight")]:
        layer = key.removesuffix(".weight")
        conf = json.loads(bytes(q[f"{layer}.comfy_quant"].tolist()))
        params = TensorWiseINT8Layout.Params(scale=q[f"{layer}.weight_scale"], orig_dtype=torch.float32,
                                             orig_shape=tuple(q[key].shape), convrot=bool(conf.get("convrot")),
                                             convrot_groupsize=4)
        dense[key] = TensorWiseINT8Layout.dequantize(q[key], params)
    assert any(json.loads(bytes(v.tolist())).get("convrot") for k, v in q.items() if k.endswith("comfy_quant"))
    return quantized, dense


@pytest.mark.parametrize("fmt", ["int8_convrot", "fp8_scaled"])
def test_a_quantized_checkpoints_parts_are_decoded_as_comfyui_decodes_them(case, tmp_path, fmt):
    """A checkpoint whose parts (connectors, text projection, VAEs, vocoder) are stored quantized:
    each part loads with every weight decoded as ComfyUI decodes it (the same model as from a file
    holding those decoded values), the pipeline runs, and the file is unchanged."""
    _folder, reference, path, configs = case
    quantized, dense = _quantized_parts(load_file(str(path)), fmt)
    files = {name: tmp_path / f"ltx-2-tiny-{name}.safetensors" for name in (fmt, "dense")}
    save_file(quantized, str(files[fmt]))
    save_file(dense, str(files["dense"]))
    before = digest(files[fmt])
    pipes = {name: load_pipeline_with_denoiser(configs, file, torch.float32) for name, file in files.items()}
    for name in HELD:
        got, want = (getattr(pipes[k], name).state_dict() for k in (fmt, "dense"))
        assert got.keys() == want.keys(), name
        assert all(torch.equal(got[k], v) for k, v in want.items()), name
    pipe = pipes[fmt]
    pipe.set_progress_bar_config(disable=True)
    out = run_ltx2(pipe, **CHECKPOINTABLE_SIZE)
    assert torch.isfinite(out.video).all() and not torch.equal(out.video, reference.video)  # quantized parts
    assert digest(files[fmt]) == before


def test_an_nvfp4_checkpoints_transformer_keeps_its_layers_and_runs_as_the_decoded_file(case, tmp_path):
    """A checkpoint whose transformer blocks are NVFP4 (as Lightricks' fp4 checkpoint): under its
    ``model.diffusion_model.`` prefix the layers load as stored NVFP4 layers, and the pipeline runs
    bit for bit as from the same checkpoint holding comfy-kitchen's decoded weights."""
    from comfy_kitchen import dequantize_nvfp4
    from diffusers_offload.offload_core.formats.nvfp4 import NVFP4Linear
    from fixtures.nvfp4_files import nvfp4_layers

    _folder, _reference, path, configs = case
    state = load_file(str(path))
    layers = [k.removesuffix(".weight") for k, v in state.items()
              if k.startswith("model.diffusion_model.transformer_blocks.") and k.endswith(".weight") and v.ndim == 2]
    quantized, dense = nvfp4_layers(state, layers), dict(state)
    for layer in layers:
        rows, cols = state[layer + ".weight"].shape
        dense[layer + ".weight"] = dequantize_nvfp4(quantized[layer + ".weight"], quantized[layer + ".weight_scale_2"],
                                                    quantized[layer + ".weight_scale"], torch.float32)[:rows, :cols].contiguous()
    files = {name: tmp_path / f"ltx-2-tiny-dev-{name}.safetensors" for name in ("fp4", "dense")}
    save_file(quantized, str(files["fp4"]))
    save_file(dense, str(files["dense"]))
    before = digest(files["fp4"])
    outs = {}
    for name, file in files.items():
        pipe = load_pipeline_with_denoiser(configs, file, torch.float32)
        pipe.set_progress_bar_config(disable=True)
        held = sum(isinstance(m, NVFP4Linear) for m in pipe.transformer.modules())
        assert held == (len(layers) if name == "fp4" else 0), name
        outs[name] = run_ltx2(pipe, **CHECKPOINTABLE_SIZE)
    torch.testing.assert_close(outs["fp4"].video, outs["dense"].video, rtol=0, atol=0)
    torch.testing.assert_close(outs["fp4"].audio, outs["dense"].audio, rtol=0, atol=0)
    assert digest(files["fp4"]) == before


def test_an_nvfp4_checkpoint_part_is_refused_by_name(case, tmp_path):
    from fixtures.nvfp4_files import nvfp4_layers

    _folder, _reference, path, configs = case
    state = load_file(str(path))
    layer = next(k.removesuffix(".weight") for k, v in state.items()
                 if k.startswith("text_embedding_projection.") and v.ndim == 2)
    fp4 = tmp_path / "ltx-2-fp4-connectors.safetensors"
    save_file(nvfp4_layers(state, [layer]), str(fp4))
    with pytest.raises(SingleFileError, match=rf"ltx-2-fp4-connectors\.safetensors: nvfp4 layers in its connectors \({layer}\)"):
        load_pipeline_with_denoiser(configs, fp4, torch.float32)


def test_an_int8_checkpoint_part_without_its_scale_is_refused_by_name(case, tmp_path):
    _folder, _reference, path, configs = case
    quantized, _dense = _quantized_parts(load_file(str(path)), "int8_convrot")
    lost = next(k for k in quantized if k.endswith(".weight_scale"))  # (only the parts are quantized)
    del quantized[lost]
    broken = tmp_path / "ltx-2-noscale.safetensors"
    save_file(quantized, str(broken))
    layer = lost.removesuffix(".weight_scale")
    match = rf"ltx-2-noscale\.safetensors: {re.escape(layer)}\.weight is stored in int8 without a weight scale"
    with pytest.raises(SingleFileError, match=match):
        load_pipeline_with_denoiser(configs, broken, torch.float32)


def test_comfyuis_gemma_file_gives_the_text_encoder_and_its_tokenizer(case, tmp_path):
    """A folder of configs only (no weight, no tokenizer: as the pack carries them; "auto" picks it
    by the checkpoint's shape) around the checkpoint and a text-only
    ComfyUI Gemma 3 file (its layout, no head, no image path, its sentencepiece model): the
    tokenizer is sentencepiece's own reading of the file's model with <bos> first (as ComfyUI's
    Gemma tokenizer and the released one), and the run equals the folder's with such a tokenizer."""
    import sentencepiece
    from diffusers_offload.offload_core.formats.file_tokenizers import tokenizer_from_file
    from fixtures.comfy_files import carried_like_copy
    from fixtures.ltx2_files import comfy_gemma3_text_state
    from fixtures.tiny_tok import tiny_gemma_spiece

    folder, _reference, path, _configs = case
    spiece = tiny_gemma_spiece()
    gemma = LTX2Pipeline.from_pretrained(str(folder), dtype=torch.float32)
    gemma.set_progress_bar_config(disable=True)
    text = tmp_path / "gemma_3_tiny_it.safetensors"
    save_file(comfy_gemma3_text_state(gemma.text_encoder.state_dict(), spiece), str(text))
    tokenizer = tokenizer_from_file(text, "GemmaTokenizer", "the test")
    reader = sentencepiece.SentencePieceProcessor(model_proto=spiece)
    for prompt in ("a cat sitting", "Ünïcødé  twice", "hello, world!"):
        assert tokenizer(prompt).input_ids == [reader.bos_id(), *reader.encode(prompt)]

    configs = carried_like_copy(folder, tmp_path / "carried" / "tiny-ltx2")
    assert carried.pick(path, False, configs.parent) == configs  # "auto": the carried folder of its shape
    pipe = load_pipeline_with_denoiser(configs, path, torch.float32, text_encoder_file=text)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.text_encoder.model.vision_tower is None and pipe.tokenizer.add_bos_token
    gemma.tokenizer.add_bos_token = True  # the folder's tiny tokenizer, as the released one
    reference = run_ltx2(gemma, **CHECKPOINTABLE_SIZE)
    out = run_ltx2(pipe, **CHECKPOINTABLE_SIZE)
    torch.testing.assert_close(out.video, reference.video, rtol=0, atol=0)
    torch.testing.assert_close(out.audio, reference.audio, rtol=0, atol=0)


def test_an_nvfp4_gemma_file_keeps_its_layers_and_encodes_as_comfy_kitchen_decodes_them(case, tmp_path):
    """ComfyUI's nvfp4-mixed Gemma 3 files (the one its LTX-2 templates name): each NVFP4 layer stays
    packed (the file's bytes), decoding at compute by comfy-kitchen's own dequantize cut from its
    16 × 16 padding (the tiny model's key and value projections are 8 rows); the encoder gives the
    bits of the same Gemma holding those decoded weights; the file unchanged."""
    from comfy_kitchen import dequantize_nvfp4
    from diffusers_offload.offload_core.formats.nvfp4 import NVFP4Linear
    from diffusers_offload.offload_core.formats.single_file_pipeline import load_text_encoder
    from fixtures.ltx2_files import comfy_gemma3_text_state
    from fixtures.nvfp4_files import nvfp4_layers
    from fixtures.tiny_tok import tiny_gemma_spiece

    folder = case[0]
    whole = LTX2Pipeline.from_pretrained(str(folder), dtype=torch.float32).text_encoder
    layers = [f"model.layers.0.self_attn.{p}_proj" for p in ("q", "k", "v", "o")] + ["model.layers.1.mlp.down_proj"]
    state = nvfp4_layers(comfy_gemma3_text_state(whole.state_dict(), tiny_gemma_spiece()), layers)
    path = tmp_path / "gemma_3_tiny_it_fp4_mixed.safetensors"
    save_file(state, str(path))
    before = digest(path)
    encoder = load_text_encoder(path, folder / "text_encoder", "Gemma3ForConditionalGeneration", torch.float32)
    original = whole.state_dict()
    keys = [layer.replace("model.", "model.language_model.", 1) + ".weight" for layer in layers]
    assert any(original[key].shape[0] % 16 for key in keys)  # some were padded in the file
    for layer, key in zip(layers, keys, strict=True):
        held = encoder.get_submodule(key.removesuffix(".weight"))
        assert isinstance(held, NVFP4Linear) and torch.equal(held.weight, state[layer + ".weight"]), key
        rows, cols = original[key].shape
        decoded = dequantize_nvfp4(state[layer + ".weight"], state[layer + ".weight_scale_2"].float(),
                                   state[layer + ".weight_scale"], torch.float32)[:rows, :cols]
        assert 0 < (decoded - original[key]).abs().max() < 0.5 * original[key].abs().max()  # fp4's error
        whole.get_submodule(key.removesuffix(".weight")).weight.data = decoded.contiguous()
    untouched = "model.language_model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(encoder.state_dict()[untouched], original[untouched], rtol=0, atol=0)
    ids = torch.tensor([[2, 5, 9, 4, 7]])
    with torch.inference_mode():
        got, want = (m.model.language_model(input_ids=ids).last_hidden_state for m in (encoder, whole))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert digest(path) == before


def test_the_tiny_checkpoint_is_in_ltx2s_original_layout(case):
    """The fixture's parts convert back exactly with diffusers' own converters (transformer, video
    VAE, audio VAE; the connectors and vocoder, which diffusers has no converter for, are the runs
    above): what ComfyUI's LTX-2 checkpoints hold, not a layout of the suite's making."""
    from diffusers.loaders.single_file_utils import (
        convert_ltx2_audio_vae_to_diffusers,
        convert_ltx2_transformer_to_diffusers,
        convert_ltx2_vae_to_diffusers,
    )

    folder, _reference, path, _configs = case
    pipe = LTX2Pipeline.from_pretrained(str(folder), dtype=torch.float32)
    state = load_file(str(path))
    for converter, prefixes, model in (
        (convert_ltx2_transformer_to_diffusers, ("model.diffusion_model.",), pipe.transformer),
        (convert_ltx2_vae_to_diffusers, ("vae.",), pipe.vae),
        (convert_ltx2_audio_vae_to_diffusers, ("audio_vae.",), pipe.audio_vae),
    ):
        back = converter({k: v for k, v in state.items() if k.startswith(prefixes)})
        expected = model.state_dict()
        assert back.keys() == expected.keys(), converter.__name__
        assert all(torch.equal(back[k], v) for k, v in expected.items()), converter.__name__

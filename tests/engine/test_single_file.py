"""ComfyUI single-file denoisers: an fp8_scaled / fp8 / ComfyUI-quant file runs like the bf16 model
holding ``fp8.to(bf16) * scale.to(bf16)`` computed here from the file (and unlike diffusers' own unscaled
load); a configs-only folder takes the text-encoder and VAE files; every bad input is refused
with an error naming the file and what it looks like, and no file changes."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline, WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import store_fp8, table_of
from diffusers_offload.offload_core.formats.inspect import SingleFileError, inspect_safetensors
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from fixtures import comfy_files, gguf_files
from fixtures.comfy_files import comfy_quant_wan_tensors, comfy_wan_tensors
from fixtures.placements import run_placed
from fixtures.tiny_models import run_ltx2, run_wan
from safetensors.torch import load_file, save_file

# session fixtures, registered under their own names (comfy_wan, wan_configs_only, wan_component_files, wan_gguf)
_FIXTURES = (comfy_files.comfy_wan, comfy_files.wan_configs_only, comfy_files.wan_component_files)
_comfy_wan, _configs_only, _component_files = _FIXTURES
_wan_gguf = gguf_files.wan_gguf_fixture
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
CONFIG = OffloadConfig(mode="auto", on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _dequantised_reference(path: Path, folder: Path, tmp: Path) -> WanTransformer3DModel:
    """The file's weights as ComfyUI computes them (``w.to(bf16) * scale.to(bf16)``, comfy-kitchen's
    reference dequantisation, written out here), keys
    converted by diffusers' Wan conversion, saved as a diffusers folder and loaded by diffusers'
    folder loader in bf16."""
    tensors = load_file(str(path))
    out = {}
    for key, t in tensors.items():
        if key == "scaled_fp8" or key.endswith((".scale_weight", ".weight_scale", ".scale_input", ".comfy_quant")):
            continue
        layer = key.removesuffix(".weight")
        scale = tensors.get(f"{layer}.scale_weight", tensors.get(f"{layer}.weight_scale"))
        value = t.to(BF16)
        out[key] = value if scale is None else value * scale.to(BF16)
    ref = tmp / f"reference-{path.stem}" / "transformer"
    ref.mkdir(parents=True)
    shutil.copyfile(folder / "transformer" / "config.json", ref / "config.json")
    save_file(convert_wan_transformer_to_diffusers(out), str(ref / "diffusion_pytorch_model.safetensors"))
    return WanTransformer3DModel.from_pretrained(str(ref), torch_dtype=BF16)


def _run_placed(pipe) -> torch.Tensor:
    return run_placed(pipe, CONFIG)


def _reference_pipe(tiny_wan_dir: Path, transformer) -> object:
    """The full tiny folder loaded by diffusers in bf16, with ``transformer`` in place of its own."""
    pipe = DiffusionPipeline.from_pretrained(str(tiny_wan_dir), dtype=BF16)
    pipe.set_progress_bar_config(disable=True)
    pipe.register_modules(transformer=transformer)
    return pipe


@pytest.mark.parametrize("fmt", ["fp8_scaled", "fp8"])
def test_fp8_file_runs_as_the_dequantised_model(fmt, comfy_wan, wan_configs_only, wan_component_files, tiny_wan_dir,
                                                tmp_path):
    path = comfy_wan(fmt)
    before = _digest(path)
    pipe = load_pipeline_with_denoiser(wan_configs_only, path, BF16, wan_component_files["text_encoder"],
                                       wan_component_files["vae"])
    fp8_weights = [p for p in pipe.transformer.parameters() if p.dtype == torch.float8_e4m3fn]
    assert len(fp8_weights) == len(table_of(pipe.transformer).weights) > 0  # stored as fp8, not upcast
    assert (len(table_of(pipe.transformer).scales) > 0) == (fmt == "fp8_scaled")
    got = _run_placed(pipe)
    reference = _reference_pipe(tiny_wan_dir, _dequantised_reference(path, tiny_wan_dir, tmp_path))
    expected = run_wan(reference)
    assert torch.equal(got, expected)
    assert _digest(path) == before


def test_scales_are_not_dropped_as_diffusers_drops_them(comfy_wan, tiny_wan_dir, tmp_path):
    """diffusers' own load of the fp8_scaled file (scales dropped) gives another output: the test
    above fails if the pack drops the scales too."""
    path = comfy_wan("fp8_scaled")
    unscaled = WanTransformer3DModel.from_single_file(str(path), config=str(tiny_wan_dir), subfolder="transformer",
                                                      local_files_only=True, torch_dtype=BF16)
    ours = load_denoiser(path, tiny_wan_dir, BF16)
    expected = run_wan(_reference_pipe(tiny_wan_dir, _dequantised_reference(path, tiny_wan_dir, tmp_path)))
    dropped = run_wan(_reference_pipe(tiny_wan_dir, unscaled))
    assert not torch.allclose(dropped, expected, atol=1e-3)
    assert torch.equal(_run_placed(_reference_pipe(tiny_wan_dir, ours)), expected)


def test_static_input_scales_follow_their_layers_and_a_two_element_marker_keeps_fp8_matmuls_off(tiny_wan_dir,
                                                                                                 tmp_path):
    """A legacy fp8_scaled file's ``scale_input`` reaches the converted layer of its weight (here 3 ×
    the weight's scale, float32); one of 1 is dropped, as ComfyUI drops it (those layers scale
    inputs at run time); a two-element ``scaled_fp8`` marker (ComfyUI: full-precision matmuls)
    keeps fp8 matmuls off where the loader asks for them."""
    tensors = comfy_wan_tensors(tiny_wan_dir, "fp8_scaled")
    for key in [k for k in tensors if k.endswith(".scale_weight")]:
        layer = key.removesuffix(".scale_weight")
        tensors[f"{layer}.scale_input"] = torch.ones(()) if ".ffn." in layer else tensors[key] * 3
    checked = {"ffn": 0, "static": 0}
    for marker, matmul in ((torch.empty(0, dtype=FP8), True), (torch.zeros(2, dtype=FP8), False)):
        path = tmp_path / f"wan-static-{marker.numel()}.safetensors"
        save_file({**tensors, "scaled_fp8": marker}, str(path))
        model = load_denoiser(path, tiny_wan_dir, BF16)
        table = store_fp8(model, FP8, BF16, matmul=True)
        assert table.matmul is matmul and ("full-precision" in table.matmul_off) is not matmul
    for name, layer in model.named_modules():
        if isinstance(layer, torch.nn.Linear) and id(layer.weight) in table.exact:
            if ".ffn." in name:
                assert id(layer.weight) not in table.inputs, name
                checked["ffn"] += 1
            else:
                assert table.inputs[id(layer.weight)] == (torch.tensor(table.exact[id(layer.weight)]) * 3).item(), name
                checked["static"] += 1
    assert checked["ffn"] and checked["static"]


def test_comfy_quant_per_tensor_fp8_loads_as_fp8_scaled(tiny_wan_dir, comfy_wan, tmp_path):
    path = tmp_path / "wan-comfy-quant.safetensors"
    save_file(comfy_quant_wan_tensors(tiny_wan_dir), str(path))
    ours = load_denoiser(path, tiny_wan_dir, BF16)
    assert table_of(ours).scales
    expected = run_wan(_reference_pipe(tiny_wan_dir, _dequantised_reference(comfy_wan("fp8_scaled"), tiny_wan_dir, tmp_path)))
    assert torch.equal(_run_placed(_reference_pipe(tiny_wan_dir, ours)), expected)


def test_bf16_file_loads_like_the_folder_loader(comfy_wan, tiny_wan_dir, tmp_path):
    """A bf16 file: converted weights, diffusers' fp32 modules kept in fp32 as from_pretrained keeps them."""
    path = comfy_wan("bf16")
    model = load_denoiser(path, tiny_wan_dir, BF16)
    file = load_file(str(path))
    assert table_of(model) is None
    assert torch.equal(model.blocks[0].attn1.to_q.weight, file["blocks.0.self_attn.q.weight"])
    assert torch.equal(model.proj_out.weight, file["head.head.weight"])
    reference = _dequantised_reference(path, tiny_wan_dir, tmp_path)
    assert {n: p.dtype for n, p in model.state_dict().items()} == {n: p.dtype for n, p in reference.state_dict().items()}


def test_an_all_in_one_checkpoint_gives_its_denoiser(comfy_wan, tiny_wan_dir, tmp_path):
    """A ComfyUI all-in-one checkpoint (models/checkpoints: the denoiser under ``model.diffusion_model.``
    beside a VAE and text encoders, as Comfy-Org's FLUX.1 ones): the denoiser is read from it and the
    rest left aside (Wan's converter passed them through, and the file was refused for them)."""
    state = {"model.diffusion_model." + k: v for k, v in load_file(str(comfy_wan("bf16"))).items()}
    state["vae.decoder.conv_in.weight"] = torch.ones(2, 2)
    state["text_encoders.umt5xxl.transformer.shared.weight"] = torch.ones(2, 2)
    path = tmp_path / "wan-tiny-checkpoint.safetensors"
    save_file(state, str(path))
    model = load_denoiser(path, tiny_wan_dir, BF16)
    reference = load_denoiser(comfy_wan("bf16"), tiny_wan_dir, BF16).state_dict()
    assert model.state_dict().keys() == reference.keys()
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())


def test_gguf_file_loads_packed(wan_gguf, wan_configs_only, wan_component_files):
    gguf = wan_gguf("Q8_0")
    pipe = load_pipeline_with_denoiser(wan_configs_only, gguf.file, BF16, wan_component_files["text_encoder"],
                                       wan_component_files["vae"])
    q = pipe.transformer.blocks[0].ffn.net[2].weight  # 32 wide: Q8_0 blocks
    assert type(q).__name__ == "GGUFParameter" and q.dtype == torch.uint8
    assert torch.isfinite(_run_placed(pipe)).all()


def test_inspect_reads_the_header(comfy_wan, wan_component_files):
    info = inspect_safetensors(comfy_wan("fp8_scaled"))
    assert (info.role, info.family, info.format, info.marker) == ("denoiser", "wan", "fp8_e4m3fn_scaled", "scaled_fp8")
    assert info.scales["blocks.0.self_attn.q"] == "blocks.0.self_attn.q.scale_weight"
    assert inspect_safetensors(wan_component_files["text_encoder"]).role == "text_encoder"
    assert inspect_safetensors(wan_component_files["vae"]).role == "vae"


# -- bad input ---------------------------------------------------------------------------------------
def _refused(match: str, path: Path, call) -> SingleFileError:
    before = _digest(path) if Path(path).is_file() else None
    with pytest.raises(SingleFileError, match=match) as err:
        call()
    assert str(path) in str(err.value) or Path(path).name in str(err.value)
    if before is not None:
        assert _digest(path) == before
    return err.value


def test_truncated_and_garbage_files_are_refused(comfy_wan, tiny_wan_dir, tmp_path):
    data = comfy_wan("fp8_scaled").read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(bytes(range(256)) * 64)
    for path in (truncated, garbage):
        _refused("truncated or corrupt", path, lambda p=path: load_denoiser(p, tiny_wan_dir, BF16))


def test_a_scale_that_does_not_match_its_weight_is_refused(tiny_wan_dir, tmp_path):
    tensors = comfy_wan_tensors(tiny_wan_dir, "fp8_scaled")
    tensors["blocks.1.ffn.0.scale_weight"] = torch.ones(4)
    path = tmp_path / "bad-scale.safetensors"
    save_file(tensors, str(path))
    _refused(r"blocks\.1\.ffn\.net\.0\.proj has shape \(4,\)", path, lambda: load_denoiser(path, tiny_wan_dir, BF16))


def test_a_file_of_another_family_is_refused(comfy_wan, tiny_flux_dir, tiny_wan_dir, tmp_path):
    wan = comfy_wan("fp8_scaled")
    err = _refused("wan denoiser.*flux model", wan, lambda: load_denoiser(wan, tiny_flux_dir, BF16))
    assert "FluxTransformer2DModel" in str(err)
    flux = tmp_path / "flux-like.safetensors"  # Flux's original key names, as BFL and Comfy-Org files hold
    save_file({"double_blocks.0.img_attn.norm.key_norm.scale": torch.ones(8),
               "img_in.weight": torch.ones(8, 64, dtype=BF16)}, str(flux))
    _refused("flux denoiser.*wan model", flux, lambda: load_denoiser(flux, tiny_wan_dir, BF16))


def test_an_unknown_comfy_quant_type_is_refused(tiny_wan_dir, tmp_path):
    path = tmp_path / "awq_w4a16.safetensors"
    save_file(comfy_quant_wan_tensors(tiny_wan_dir, "awq_w4a16"), str(path))
    _refused("comfy-kitchen layouts \\(awq_w4a16\\)", path, lambda: load_denoiser(path, tiny_wan_dir, BF16))
    meta = tmp_path / "int8-metadata.safetensors"
    tensors = comfy_wan_tensors(tiny_wan_dir, "bf16")
    save_file(tensors, str(meta), metadata={"_quantization_metadata": json.dumps(
        {"format_version": "1.0", "layers": {"blocks.0.self_attn.q": {"format": "int8_tensorwise"}}})})
    _refused("int8_tensorwise", meta, lambda: load_denoiser(meta, tiny_wan_dir, BF16))


def test_a_text_encoder_given_as_the_denoiser_is_refused(wan_component_files, tiny_wan_dir):
    te = wan_component_files["text_encoder"]
    _refused("looks like a T5/UMT5 text encoder, not a denoiser", te, lambda: load_denoiser(te, tiny_wan_dir, BF16))
    vae = wan_component_files["vae"]
    _refused("pick it as the VAE file", vae, lambda: load_denoiser(vae, tiny_wan_dir, BF16))


def test_a_truncated_gguf_is_refused(wan_gguf, tiny_wan_dir, tmp_path):
    data = wan_gguf("Q8_0").file.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match="truncated.gguf"):
        load_denoiser(path, tiny_wan_dir, BF16)


def test_a_configs_only_folder_names_the_file_to_pick(comfy_wan, wan_configs_only, wan_component_files):
    with pytest.raises(SingleFileError, match="no weights for text_encoder .*pick a text-encoder file"):
        load_pipeline_with_denoiser(wan_configs_only, comfy_wan("fp8_scaled"), BF16)
    with pytest.raises(SingleFileError, match="no weights for vae .*pick a VAE file"):
        load_pipeline_with_denoiser(wan_configs_only, comfy_wan("fp8_scaled"), BF16,
                                    text_encoder_file=wan_component_files["text_encoder"])
    with pytest.raises(SingleFileError, match="looks like a wan denoiser, not a text-encoder file"):
        load_pipeline_with_denoiser(wan_configs_only, comfy_wan("fp8_scaled"), BF16,
                                    text_encoder_file=comfy_wan("fp8"), vae_file=wan_component_files["vae"])


def test_a_second_text_encoder_file_for_a_pipeline_without_one_is_refused(comfy_wan, wan_configs_only,
                                                                          wan_component_files):
    with pytest.raises(SingleFileError, match="WanPipeline .* has no text_encoder_2: leave its second text-encoder"):
        load_pipeline_with_denoiser(wan_configs_only, comfy_wan("bf16"), BF16, **{
            "text_encoder_file": wan_component_files["text_encoder"], "vae_file": wan_component_files["vae"],
            "text_encoder_2_file": wan_component_files["text_encoder"]})


def test_an_ltx2_transformer_file_runs_in_an_ltx2_folders_pipeline(ltx2_pipe, tiny_ltx2_dir, tmp_path):
    """LTX-2's original layout (what ComfyUI's LTX-2 files hold) is told from LTX-Video's: diffusers
    0.42.1's detector calls it LTX-Video 0.9.7 (it tests LTX-Video's keys, which LTX-2 files also
    hold, first), and the file was refused against an LTX-2 config folder as another family. The
    pipeline around it takes the folder's connectors and vocoder (index library ``ltx2``, a diffusers
    pipeline module, which failed to import) and runs as the folder's."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers
    from fixtures.ltx2_files import original_ltx2_transformer_state

    folder = LTX2VideoTransformer3DModel.from_pretrained(str(tiny_ltx2_dir / "transformer"))
    state = original_ltx2_transformer_state(folder.state_dict())
    assert convert_ltx2_transformer_to_diffusers(dict(state)).keys() == folder.state_dict().keys()  # the layout
    path = tmp_path / "ltx-2-tiny.safetensors"
    save_file(state, str(path))

    info = inspect_safetensors(path)
    assert (info.family, info.role) == ("ltx2", "denoiser")
    model = load_denoiser(path, tiny_ltx2_dir, torch.float32)
    assert type(model) is LTX2VideoTransformer3DModel
    loaded = model.state_dict()
    for key, value in folder.state_dict().items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
    reference = run_ltx2(ltx2_pipe)
    pipe = load_pipeline_with_denoiser(tiny_ltx2_dir, path, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe.connectors).__name__ == "LTX2TextConnectors" and type(pipe.vocoder).__name__ == "LTX2Vocoder"
    out = run_ltx2(pipe)
    torch.testing.assert_close(out.video, reference.video, rtol=0, atol=0)
    torch.testing.assert_close(out.audio, reference.audio, rtol=0, atol=0)

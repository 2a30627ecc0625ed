"""T5 / UMT5 text encoders from llama.cpp GGUF files (city96's umt5-xxl-encoder GGUFs, written here
by the `gguf` package): the encoder's Linear layers keep the file's packed bytes (diffusers'
GGUFLinear), its embedding table and T5's ``wo`` are decoded, and the pipeline runs as with an
encoder holding the decoded values, moved by each transport; files of another kind, class or
shape are refused by name; the file is left unchanged."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from diffusers.models.model_loading_utils import load_gguf_checkpoint
from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats.inspect import SingleFileError
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from fixtures import comfy_files, gguf_files
from fixtures.gguf_text_encoders import TYPES, t5_state, write_t5_gguf
from fixtures.placements import run_placed_seeing
from transformers import UMT5EncoderModel

BF16 = torch.bfloat16
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
PLACEMENTS = {"none": OffloadConfig(mode="none", **BASE), "auto": OffloadConfig(mode="auto", **BASE),
              "leaf": OffloadConfig(mode="leaf", **BASE)}
TRANSPORTS = {"none": "ResidentTransport", "auto": "EncoderStreamer", "leaf": "LeafGroupTransport"}
PACKED = ("q", "k", "v", "o", "wi_0", "wi_1")  # the tiny UMT5's layers whose width tiles quant blocks
_comfy_wan, _configs_only, _component_files, _wan_gguf = (comfy_files.comfy_wan, comfy_files.wan_configs_only,
                                                          comfy_files.wan_component_files, gguf_files.wan_gguf_fixture)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module", params=TYPES)
def te_gguf(request, wan_component_files, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("te-gguf") / f"umt5-tiny-encoder-{request.param}.gguf"
    return write_t5_gguf(t5_state(wan_component_files["text_encoder"]), out, request.param)


def _pipe(te: Path, comfy_wan, wan_configs_only, wan_component_files):
    return load_pipeline_with_denoiser(wan_configs_only, comfy_wan("bf16"), BF16, te, wan_component_files["vae"])


def _decoded_twin(config: Path, te: Path, cls: type = UMT5EncoderModel) -> torch.nn.Module:
    """The tiny encoder of ``config`` holding the file's values as diffusers' GGUF layers compute with them."""
    from gguf import get_tensor_name_map
    from gguf.constants import MODEL_ARCH

    twin = cls.from_pretrained(str(config), dtype=BF16)
    names = get_tensor_name_map(MODEL_ARCH.T5ENCODER, twin.config.num_layers)
    ours = {names.get_name(k, try_suffixes=(".weight",)): k for k in twin.state_dict()}
    values = {ours[k]: dequantize_gguf_tensor(v).to(BF16) for k, v in load_gguf_checkpoint(str(te)).items()}
    missing, unexpected = twin.load_state_dict(values, strict=False)
    assert not unexpected and set(missing) <= {"encoder.embed_tokens.weight"}
    return twin


def test_the_encoder_keeps_the_files_packed_linear_layers(te_gguf, comfy_wan, wan_configs_only,
                                                          wan_component_files) -> None:
    before = _digest(te_gguf)
    encoder = _pipe(te_gguf, comfy_wan, wan_configs_only, wan_component_files).text_encoder
    packed = {n for n, p in encoder.named_parameters() if isinstance(p, GGUFParameter)}
    assert packed == {n for n, _ in encoder.named_parameters() if n.rsplit(".", 2)[-2] in PACKED}
    assert {encoder.get_parameter(n).quant_type.name for n in packed} == {te_gguf.stem.rsplit("-", 1)[1]}
    assert encoder.shared.weight.dtype == BF16 and encoder.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == BF16
    assert _digest(te_gguf) == before


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_pipeline_runs_as_with_the_decoded_encoder_in_every_placement(
        placement, te_gguf, comfy_wan, wan_configs_only, wan_component_files, tiny_wan_dir) -> None:
    reference = _pipe(te_gguf, comfy_wan, wan_configs_only, wan_component_files)
    reference.register_modules(text_encoder=_decoded_twin(tiny_wan_dir / "text_encoder", te_gguf))
    expected, _ = run_placed_seeing(reference, PLACEMENTS["none"], "text_encoder")
    pipe = _pipe(te_gguf, comfy_wan, wan_configs_only, wan_component_files)
    out, transport = run_placed_seeing(pipe, PLACEMENTS[placement], "text_encoder")
    assert torch.equal(out, expected) and transport == TRANSPORTS[placement]
    assert any(isinstance(p, GGUFParameter) for p in pipe.text_encoder.parameters())  # released: still packed


def test_files_of_another_kind_class_or_shape_are_refused_by_name(
        comfy_wan, wan_configs_only, wan_component_files, wan_gguf, tiny_flux_dir, tmp_path) -> None:
    state = t5_state(wan_component_files["text_encoder"])
    te = write_t5_gguf(state, tmp_path / "umt5-tiny-Q8_0.gguf")
    with pytest.raises(SingleFileError, match=r"wan-tiny-Q8_0\.gguf looks like a wan denoiser, not a text-encoder"):
        _pipe(wan_gguf("Q8_0").file, comfy_wan, wan_configs_only, wan_component_files)
    with pytest.raises(SingleFileError, match=r"umt5-tiny-Q8_0\.gguf looks like a T5/UMT5 text encoder .*, not a "
                                              r"denoiser: pick it as the text-encoder file"):
        load_denoiser(te, wan_configs_only, BF16)
    clip = tiny_flux_dir / "text_encoder"
    with pytest.raises(SingleFileError, match=r"is a T5 text encoder \(GGUF\), but the text encoder of .* is a "
                                              r"CLIPTextModel"):
        from diffusers_offload.offload_core.formats.gguf_text_encoder import load_gguf_text_encoder
        load_gguf_text_encoder(te, clip, "CLIPTextModel", BF16)
    narrow = {k: v[:16] if k.endswith("wi_0.weight") else v for k, v in state.items()}
    bad = write_t5_gguf(narrow, tmp_path / "umt5-narrow.gguf")
    with pytest.raises(SingleFileError, match=r"umt5-narrow\.gguf: enc\.blk\.0\.ffn_gate\.weight has shape \(16, 32\), "
                                              r"the UMT5EncoderModel config gives \(37, 32\)"):
        _pipe(bad, comfy_wan, wan_configs_only, wan_component_files)


def test_a_t5_file_for_flux_encodes_as_the_decoded_t5(tiny_flux_dir: Path, tmp_path: Path) -> None:
    """Flux's T5 (city96's t5-v1_1-xxl-encoder GGUFs: a T5EncoderModel, one relative-attention bias,
    a ReLU feed-forward ``wi``), straight from the loader (GGUF layers compute unplaced too)."""
    from diffusers_offload.offload_core.formats.gguf_text_encoder import load_gguf_text_encoder
    from transformers import T5EncoderModel

    config = tiny_flux_dir / "text_encoder_2"
    te = write_t5_gguf(t5_state(next(config.glob("*.safetensors"))), tmp_path / "t5-tiny-encoder-Q8_0.gguf",
                       name="t5-v1_1-xxl")
    encoder = load_gguf_text_encoder(te, config, "T5EncoderModel", BF16)
    assert any(isinstance(p, GGUFParameter) for p in encoder.parameters())
    ids = torch.tensor([[3, 7, 11, 2, 9, 1]])
    with torch.inference_mode():
        got = encoder(ids).last_hidden_state
        assert torch.equal(got, _decoded_twin(config, te, T5EncoderModel)(ids).last_hidden_state)

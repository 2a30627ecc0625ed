"""ComfyUI W4A8 single files (comfy-kitchen's ``asym_w4a8_int8``, quantized here by comfy-kitchen's
own quantizer): loaded with their packed int4 weights and scales kept as stored, and run, in every
placement, bit for bit like ComfyUI's layer — the same model with each such weight a comfy-kitchen
``QuantizedTensor`` (``AsymW4A8Int8Layout``) under a plain ``nn.Linear``, as ComfyUI's mixed
precision ops hold it; what the streamer moves is storage bytes; a release leaves the stored
tensors as they were; bad files and a missing comfy-kitchen are refused by name; no file changes."""

import json
import sys
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import dequantize_int8, table_of
from diffusers_offload.offload_core.formats.inspect import SingleFileError
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from diffusers_offload.offload_core.formats.stored_linear import kitchen_module
from diffusers_offload.offload_core.formats.w4a8 import W4A8Linear
from diffusers_offload.offload_core.lora import LoraSpec, activate
from diffusers_offload.offload_core.state import leftovers
from fixtures import comfy_files
from fixtures.comfy_files import W4A8_CONF, comfy_w4a8_wan_tensors, write_comfy_w4a8_wan
from fixtures.placements import PLACEMENTS
from fixtures.quantized import (
    assert_streams_stored_bytes,
    comfyui_twin,
    digest,
    refused,
    runs_as_keeping_stored,
    wan_pipe,
)
from fixtures.tiny_loras import wan_lora
from fixtures.tiny_models import load_wan, run_wan
from safetensors.torch import load_file, save_file

# session fixtures, registered under their own names (comfy_wan, wan_configs_only, wan_component_files)
_comfy_wan, _configs_only, _component_files = (comfy_files.comfy_wan, comfy_files.wan_configs_only,
                                               comfy_files.wan_component_files)
BF16 = torch.bfloat16
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, detached (a W4A8 layer's scales are buffers)."""
    return {n: t.detach() for n, t in (*model.named_parameters(), *model.named_buffers())}


@pytest.fixture(scope="module")
def w4a8_file(tiny_wan_dir, tmp_path_factory) -> Path:
    return write_comfy_w4a8_wan(tiny_wan_dir, tmp_path_factory.mktemp("w4a8") / "wan-tiny-w4a8.safetensors")


def _comfyui_twin(path: Path, folder: Path, tmp: Path) -> WanTransformer3DModel:
    """The file as ComfyUI holds it (`quantized.comfyui_twin`): each W4A8 layer's weight a
    comfy-kitchen ``QuantizedTensor``, which ``nn.Linear``'s ``F.linear`` dispatches to comfy-kitchen."""
    from comfy_kitchen.tensor.base import QuantizedTensor
    from comfy_kitchen.tensor.w4a8_int8 import AsymW4A8Int8Layout, dequantize_w4a8_int8_weight

    geometry = dict(group_size=W4A8_CONF["group_size"], convrot_groupsize=W4A8_CONF["convrot_groupsize"])

    def decode(tensors: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
        return dequantize_w4a8_int8_weight(
            tensors[f"{layer}.weight"], tensors[f"{layer}.weight_s_rel"], tensors[f"{layer}.weight_s_channel"],
            codebook=tensors.get(f"{layer}.weight_codebook"), output_dtype=BF16, **geometry)

    def held(tensors: dict[str, torch.Tensor], layer: str, linear: torch.nn.Linear) -> QuantizedTensor:
        params = AsymW4A8Int8Layout.Params(
            scale=tensors[f"{layer}.weight_s_rel"], s_channel=tensors[f"{layer}.weight_s_channel"],
            codebook=tensors.get(f"{layer}.weight_codebook"), orig_dtype=BF16,
            orig_shape=(linear.out_features, linear.in_features), **geometry)
        return QuantizedTensor(tensors[f"{layer}.weight"], "AsymW4A8Int8Layout", params)

    return comfyui_twin(path, folder, tmp, "cpu", decode, held)


@pytest.fixture(scope="module")
def reference(tiny_wan_dir, w4a8_file, tmp_path_factory) -> torch.Tensor:
    return run_wan(wan_pipe(tiny_wan_dir, _comfyui_twin(w4a8_file, tiny_wan_dir, tmp_path_factory.mktemp("twin"))))


def test_the_file_is_comfy_kitchens_w4a8(w4a8_file):
    """The fixture holds what ComfyUI's loader reads: packed int8 weights, fp8 group scales,
    float32 channel scales and codebooks, on the blocks (streamed) and outside them."""
    tensors = load_file(str(w4a8_file))
    layers = [k.removesuffix(".weight_s_rel") for k in tensors if k.endswith(".weight_s_rel")]
    assert any(k.startswith("blocks.") for k in layers) and any(not k.startswith("blocks.") for k in layers)
    for layer in layers:
        q, s_rel = tensors[f"{layer}.weight"], tensors[f"{layer}.weight_s_rel"]
        assert q.dtype == torch.int8 and s_rel.dtype == torch.float8_e4m3fn
        assert s_rel.shape == (q.shape[0], q.shape[1] * 2 // W4A8_CONF["group_size"])
        assert tensors[f"{layer}.weight_s_channel"].shape == (q.shape[0],)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_w4a8_file_runs_as_comfyui_in_every_placement(placement, tiny_wan_dir, w4a8_file, reference):
    before = digest(w4a8_file)
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(w4a8_file, tiny_wan_dir, BF16))
    model = pipe.transformer
    layers = [m for m in model.modules() if isinstance(m, W4A8Linear)]
    assert layers and any(isinstance(m, W4A8Linear) for m in model.blocks.modules())
    assert model.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32  # decoded, fp32 module
    runs_as_keeping_stored(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE), reference,
                           (torch.int8, torch.float8_e4m3fn))
    assert digest(w4a8_file) == before


def test_a_wrong_codebook_changes_the_output(tiny_wan_dir, w4a8_file, reference):
    """The codebooks are read from the file: the uniform int4 grid in their place gives another
    output (a pack that dropped them would pass the placement test only by luck)."""
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(w4a8_file, tiny_wan_dir, BF16))
    for layer in pipe.transformer.modules():
        if isinstance(layer, W4A8Linear) and layer.weight_codebook is not None:
            layer.weight_codebook.data = torch.linspace(-1, 1, 16)
    assert not torch.allclose(run_wan(pipe), reference, atol=1e-3)


def test_streamer_moves_w4a8_storage_bytes(tiny_wan_dir, w4a8_file, monkeypatch):
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(w4a8_file, tiny_wan_dir, BF16))
    assert_streams_stored_bytes(pipe, monkeypatch, {torch.int8, torch.float8_e4m3fn}, "comfy asym_w4a8_int8", **BASE)


LORA_TARGETS = ("to_q", "to_k", "ffn.net.2")  # attention is bf16 in the file (fused), ffn.net.2 W4A8 (unfused)


@pytest.fixture(scope="module")
def w4a8_lora(tiny_wan_dir, tmp_path_factory) -> Path:
    return wan_lora(load_wan(tiny_wan_dir).transformer, tmp_path_factory.mktemp("w4a8-lora"), seed=5,
                    targets=LORA_TARGETS)


@pytest.fixture(scope="module")
def with_lora(tiny_wan_dir, w4a8_file, w4a8_lora) -> torch.Tensor:
    """Mode none's output with the LoRA."""
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(w4a8_file, tiny_wan_dir, BF16))
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="none", **BASE))
    activate(pipe, [LoraSpec(str(w4a8_lora))])
    out = run_wan(pipe)
    activate(pipe, [])
    engine.release(pipe)
    return out


@pytest.mark.parametrize("placement", ["auto", "auto-keep-some", "leaf"])
def test_lora_on_w4a8_layers_is_unfused_and_comes_off_bit_exactly(
        placement, tiny_wan_dir, w4a8_file, w4a8_lora, with_lora, reference):
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(w4a8_file, tiny_wan_dir, BF16))
    model = pipe.transformer
    w4a8 = {n for n, m in model.named_modules() if isinstance(m, W4A8Linear) and n.startswith("blocks.")}
    stored = {n: t.clone() for n, t in _tensors(model).items() if n.rpartition(".")[0] in w4a8}
    engine = Engine()
    engine.place(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE))
    activate(pipe, [LoraSpec(str(w4a8_lora))])
    assert torch.equal(run_wan(pipe), with_lora) and not torch.equal(with_lora, reference)
    lora = engine.report(pipe).component("transformer").details["lora"]
    assert lora["path"] == "fused+unfused" and lora["unfused"] == dict.fromkeys(sorted(w4a8), "w4a8")
    assert all(torch.equal(_tensors(model)[n], t) for n, t in stored.items()), "a W4A8 tensor was written"
    activate(pipe, [])
    assert torch.equal(run_wan(pipe), reference)
    engine.release(pipe)
    assert leftovers(model) == []


# -- refused by name, files untouched ---------------------------------------------------------------

def test_inconsistent_w4a8_files_arerefused(tiny_wan_dir, tmp_path):
    tensors = comfy_w4a8_wan_tensors(tiny_wan_dir)
    layer = next(k.removesuffix(".weight_s_rel") for k in tensors if k.endswith(".weight_s_rel"))
    lacking = {k: v for k, v in tensors.items() if k != f"{layer}.weight_s_channel"}
    path = tmp_path / "wan-w4a8-lacking.safetensors"
    save_file(lacking, str(path))
    refused(rf"{layer} is declared asym_w4a8_int8 but the file lacks weight_s_channel", path, tiny_wan_dir)
    other = comfy_w4a8_wan_tensors(tiny_wan_dir, dict(W4A8_CONF, group_size=32))
    mixed = {k: (other if k.startswith("blocks.0.") else tensors)[k] for k in tensors}
    path = tmp_path / "wan-w4a8-mixed.safetensors"
    save_file(mixed, str(path))
    refused(r"W4A8 \(asym_w4a8_int8\) layers use 2 group geometries", path, tiny_wan_dir)


def test_without_comfy_kitchen_a_w4a8_file_is_refused_naming_it(tiny_wan_dir, w4a8_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "comfy_kitchen.tensor.w4a8_int8", None)  # import fails as if not installed
    kitchen_module.cache_clear()  # an earlier test's import is remembered
    err = refused(r"W4A8 \(asym_w4a8_int8\) file: .*comfy-kitchen", w4a8_file, tiny_wan_dir)
    assert "pip install comfy-kitchen" in str(err)


# -- text-encoder files ------------------------------------------------------------
def _text_encoder_file(source: Path, out: Path, fmt: str) -> Path:
    """The tiny UMT5 file with its matrices of input width 32 stored as ComfyUI ``fmt`` layers:
    W4A8 quantized by comfy-kitchen, or int8_tensorwise with per-row scales (or ``fmt`` declared
    as is, for a format the pack refuses)."""
    from comfy_kitchen.tensor.w4a8_int8 import quantize_w4a8_int8_weight

    tensors = {}
    for name, t in load_file(str(source)).items():
        if not (name.endswith(".weight") and t.ndim == 2 and t.shape[1] == 32 and ".layer." in name):  # Linears only
            tensors[name] = t
            continue
        layer = name.removesuffix(".weight")
        if fmt == "asym_w4a8_int8":
            q, s_rel, s_channel, _c, codebook = quantize_w4a8_int8_weight(t.to(BF16), group_size=16, convrot_groupsize=16)
            tensors |= {name: q, f"{layer}.weight_s_rel": s_rel, f"{layer}.weight_s_channel": s_channel,
                        f"{layer}.weight_codebook": codebook}
            conf = dict(W4A8_CONF)
        else:
            scale = t.abs().amax(dim=1, keepdim=True) / 127.0
            tensors |= {name: (t / scale).round().clamp(-127, 127).to(torch.int8), f"{layer}.weight_scale": scale}
            conf = {"format": fmt}
        tensors[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    save_file(tensors, str(out))
    return out


def test_an_int8_text_encoder_file_keeps_int8_computing_comfy_kitchens_values(
        comfy_wan, wan_configs_only, wan_component_files, tmp_path):
    """Its int8_tensorwise Linear weights stay int8 (the file's bytes), each computing from
    comfy-kitchen's ``(q.float() * scale).to(bf16)``."""
    path = _text_encoder_file(wan_component_files["text_encoder"], tmp_path / "umt5-int8.safetensors", "int8_tensorwise")
    before = digest(path)
    pipe = load_pipeline_with_denoiser(wan_configs_only, comfy_wan("fp8"), BF16, path, wan_component_files["vae"])
    tensors = load_file(str(path))
    layers = [k.removesuffix(".comfy_quant") for k in tensors if k.endswith(".comfy_quant")]
    table = table_of(pipe.text_encoder)
    assert layers and table.int8
    for layer in layers:
        weight = pipe.text_encoder.get_parameter(f"{layer}.weight")
        expected = (tensors[f"{layer}.weight"].float() * tensors[f"{layer}.weight_scale"]).to(BF16)
        assert torch.equal(weight, tensors[f"{layer}.weight"]), layer
        assert torch.equal(dequantize_int8(weight, table.int8_scale(weight, weight.device), BF16), expected), layer
    assert digest(path) == before


def test_a_w4a8_text_encoder_file_keeps_its_layers_and_encodes_as_comfyui(
        tiny_wan_dir, comfy_wan, wan_configs_only, wan_component_files, tmp_path):
    """A W4A8 text encoder stays W4A8 (its decoded bf16 is what the file was chosen to avoid): the
    layers hold the file's tensors, nothing else of the model is left empty, and it encodes like the
    same encoder holding each W4A8 layer as ComfyUI does (comfy-kitchen's QuantizedTensor)."""
    from comfy_kitchen.tensor.base import QuantizedTensor
    from comfy_kitchen.tensor.w4a8_int8 import AsymW4A8Int8Layout
    from transformers import UMT5EncoderModel

    path = _text_encoder_file(wan_component_files["text_encoder"], tmp_path / "umt5-w4a8.safetensors", "asym_w4a8_int8")
    before = digest(path)
    pipe = load_pipeline_with_denoiser(wan_configs_only, comfy_wan("fp8"), BF16, path, wan_component_files["vae"])
    encoder = pipe.text_encoder
    tensors = load_file(str(path))
    layers = [k.removesuffix(".comfy_quant") for k in tensors if k.endswith(".comfy_quant")]
    assert layers and all(isinstance(encoder.get_submodule(n), W4A8Linear) for n in layers)
    assert not any(t.is_meta for t in _tensors(encoder).values()) and encoder.dtype == BF16
    assert table_of(encoder) is None  # (its fp8 group scales are the W4A8 layers' own: no fp8 table)
    twin = UMT5EncoderModel.from_pretrained(str(tiny_wan_dir / "text_encoder"), dtype=BF16)
    for layer in layers:
        linear = twin.get_submodule(layer)
        params = AsymW4A8Int8Layout.Params(
            scale=tensors[f"{layer}.weight_s_rel"], s_channel=tensors[f"{layer}.weight_s_channel"],
            codebook=tensors[f"{layer}.weight_codebook"], orig_dtype=BF16,
            orig_shape=tuple(linear.weight.shape), group_size=16, convrot_groupsize=16)
        linear.weight = torch.nn.Parameter(
            QuantizedTensor(tensors[f"{layer}.weight"], "AsymW4A8Int8Layout", params), requires_grad=False)
    ids = torch.tensor([[3, 7, 11, 2, 9, 1]])
    with torch.inference_mode():
        assert torch.equal(encoder(ids).last_hidden_state, twin(ids).last_hidden_state)
    assert digest(path) == before


def test_a_text_encoder_file_in_a_format_the_pack_cannot_run_is_refused(
        comfy_wan, wan_configs_only, wan_component_files, tmp_path):
    path = _text_encoder_file(wan_component_files["text_encoder"], tmp_path / "umt5-awq.safetensors", "awq_w4a16")
    with pytest.raises(SingleFileError, match=r"umt5-awq\.safetensors .*comfy-kitchen layouts \(awq_w4a16\)"):
        load_pipeline_with_denoiser(wan_configs_only, comfy_wan("fp8"), BF16, path, wan_component_files["vae"])


def test_an_h3_w4a8_file_in_comfy_layout_splits_fused_layers_row_by_row(tmp_path):
    """MiniMax-H3 circulates as ComfyUI W4A8 files in the Comfy-Org layout, whose attention is one
    fused ``[q; k; v]`` layer and whose feed-forward input is ``[gate; value]``: diffusers'
    conversion splits and reorders those rows, and each part must take its own rows' scales.
    W4A8 quantizes row by row (one codebook per layer: the fixed one for these weights), so each
    loaded layer equals comfy-kitchen's quantization of the model's own layer."""
    from comfy_kitchen.tensor.w4a8_int8 import quantize_w4a8_int8_weight
    from diffusers import MiniMaxH3Transformer3DModel
    from fixtures.h3_files import build_wide_h3, comfy_h3_state_dict, w4a8_layers, write

    folder = build_wide_h3(tmp_path / "h3")
    original = MiniMaxH3Transformer3DModel.from_pretrained(str(folder / "transformer"), torch_dtype=BF16)
    state = original.state_dict()
    path = write(w4a8_layers(comfy_h3_state_dict(state, dict(original.config))), tmp_path / "h3-w4a8.safetensors")
    before = digest(path)
    model = load_denoiser(path, folder, BF16)
    assert isinstance(model.context_embedder, W4A8Linear) and model.dtype == BF16  # H3 casts its inputs to it
    got = {n: m for n, m in model.named_modules() if isinstance(m, W4A8Linear)}
    split = {f"transformer_blocks.0.attn.{p}" for p in ("to_q", "to_k", "to_v")} | {"transformer_blocks.0.ff.net.0.proj"}
    assert split <= set(got)
    for name, layer in got.items():
        q, s_rel, s_channel, _correction, codebook = quantize_w4a8_int8_weight(
            state[f"{name}.weight"].to(BF16), group_size=16, convrot_groupsize=16)
        assert torch.equal(layer.weight, q), name
        assert torch.equal(layer.weight_s_rel.view(torch.uint8), s_rel.view(torch.uint8)), name
        assert torch.equal(layer.weight_s_channel, s_channel) and torch.equal(layer.weight_codebook, codebook), name
    assert digest(path) == before


@pytest.fixture(scope="module")
def w4a8_te_pipe(comfy_wan, wan_configs_only, wan_component_files, tmp_path_factory):
    """The tiny Wan with a W4A8 text encoder file, and its output resident (mode none)."""
    path = _text_encoder_file(wan_component_files["text_encoder"],
                              tmp_path_factory.mktemp("te") / "umt5-w4a8.safetensors", "asym_w4a8_int8")
    pipe = load_pipeline_with_denoiser(wan_configs_only, comfy_wan("fp8"), BF16, path, wan_component_files["vae"])
    pipe.set_progress_bar_config(disable=True)
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="none", **BASE))
    out = run_wan(pipe)
    engine.release(pipe)
    return pipe, out


@pytest.mark.parametrize("placement", ["auto", "auto-keep-none", "model", "leaf"])
def test_a_w4a8_text_encoder_runs_alike_in_every_placement(placement, w4a8_te_pipe):
    pipe, expected = w4a8_te_pipe
    stored = {n: t.clone() for n, t in _tensors(pipe.text_encoder).items() if t.dtype in (torch.int8, torch.float8_e4m3fn)}
    engine = Engine()
    engine.place(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE))
    out = run_wan(pipe)
    engine.release(pipe)
    assert torch.equal(out, expected)
    assert leftovers(pipe.text_encoder) == []
    assert all(torch.equal(_tensors(pipe.text_encoder)[n], t) for n, t in stored.items())

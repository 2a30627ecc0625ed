"""MiniMax-H3's conditioner kept to the layers its conditioning reads, from its folder
(`trim_conditioner`) or from a text-encoder file in ComfyUI's layout (`load_conditioner_file`).
The tiny H3's Qwen3-VL has 53 layers and H3 reads ``hidden_states[50]``: 50 stay. Each way, the
pipeline generates bit for bit what the whole conditioner gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers_offload.offload_core.components import module_bytes
from diffusers_offload.offload_core.formats.inspect import SingleFileError
from diffusers_offload.offload_core.models.minimax_h3.conditioner import (
    NoHead,
    load_conditioner_file,
    trim_conditioner,
)
from fixtures.h3_files import comfy_conditioner_state_dict, write
from fixtures.quantized import digest
from fixtures.tiny_pipes import run_h3


def _same(out, reference) -> None:
    torch.testing.assert_close(out.video, reference.video, rtol=0, atol=0)
    torch.testing.assert_close(out.audio, reference.audio, rtol=0, atol=0)


def test_the_layers_after_the_one_read_go_and_the_output_stays_bit_exact(h3_pipe):
    encoder = h3_pipe.text_encoder
    assert h3_pipe.text_encoder_layer == 50 and len(encoder.model.language_model.layers) == 53
    reference = run_h3(h3_pipe)
    before = module_bytes(encoder)
    layer = encoder.model.language_model.layers[50]

    assert trim_conditioner(h3_pipe) == 3
    assert len(encoder.model.language_model.layers) == 50
    assert module_bytes(encoder) == before - 3 * module_bytes(layer)
    _same(run_h3(h3_pipe), reference)
    assert trim_conditioner(h3_pipe) == 0  # already at its layers
    _same(run_h3(h3_pipe), reference)


def test_other_pipelines_are_left_alone(wan_pipe):
    layers = len(wan_pipe.text_encoder.encoder.block)
    assert trim_conditioner(wan_pipe) == 0 and len(wan_pipe.text_encoder.encoder.block) == layers


@pytest.mark.parametrize("layout", ["comfy", "transformers"])
def test_a_conditioner_file_generates_like_the_folder(h3_pipe, tiny_h3_dir: Path, tmp_path: Path, layout):
    """ComfyUI's layout (``model.layers.*``, ``visual.*``, 50 layers, no head, no final norm) and
    transformers' own (every layer, the head): the layers past the 50th are dropped, the file never
    written; without its final norm the conditioning is the same (H3 reads the last state unnormed)."""
    whole = h3_pipe.text_encoder.state_dict()
    state = comfy_conditioner_state_dict(whole, 50) if layout == "comfy" else whole
    path = tmp_path / f"h3_conditioner_{layout}.safetensors"
    write(state, path)
    before = digest(path)
    reference = run_h3(h3_pipe)

    encoder = load_conditioner_file(path, tiny_h3_dir / "text_encoder", torch.float32, 50)
    assert len(encoder.model.language_model.layers) == 50
    assert not any(t.is_meta for t in (*encoder.parameters(), *encoder.buffers()))
    assert isinstance(encoder.lm_head, NoHead) == (layout == "comfy")
    assert isinstance(encoder.model.language_model.norm, torch.nn.Identity) == (layout == "comfy")
    h3_pipe.update_components(text_encoder=encoder)
    _same(run_h3(h3_pipe), reference)
    assert digest(path) == before


def test_a_file_short_of_the_layer_read_is_refused(h3_pipe, tiny_h3_dir: Path, tmp_path: Path):
    path = tmp_path / "short.safetensors"
    write(comfy_conditioner_state_dict(h3_pipe.text_encoder.state_dict(), 40), path)
    with pytest.raises(SingleFileError, match="holds 40 language-model layers; MiniMax-H3 reads the output of the "
                                              "first 50"):
        load_conditioner_file(path, tiny_h3_dir / "text_encoder", torch.float32, 50)


def test_a_w4a8_conditioner_file_keeps_its_layers_and_reads_like_comfyui(h3_pipe, tiny_h3_dir: Path, tmp_path: Path):
    """MiniMax-H3 circulates as ComfyUI W4A8 files: the conditioner's layers stay W4A8, and the
    hidden state H3 reads equals that of the folder's encoder holding each of those layers as
    ComfyUI does (comfy-kitchen's QuantizedTensor)."""
    from comfy_kitchen.tensor.base import QuantizedTensor
    from comfy_kitchen.tensor.w4a8_int8 import AsymW4A8Int8Layout
    from diffusers_offload.offload_core.formats.w4a8 import W4A8Linear
    from fixtures.h3_files import w4a8_layers
    from safetensors.torch import load_file
    from transformers import Qwen3VLForConditionalGeneration

    comfy = comfy_conditioner_state_dict(h3_pipe.text_encoder.to(torch.bfloat16).state_dict(), 50)
    layers = {k: v for k, v in comfy.items() if k.startswith("model.layers.")}  # not the embedding table
    path = tmp_path / "h3_conditioner_w4a8.safetensors"
    write({**comfy, **w4a8_layers(layers)}, path)
    tensors = load_file(str(path))
    quantized = [k.removesuffix(".comfy_quant") for k in tensors if k.endswith(".comfy_quant")]

    encoder = load_conditioner_file(path, tiny_h3_dir / "text_encoder", torch.bfloat16, 50)
    ours = ["model.language_model." + n.removeprefix("model.") for n in quantized]
    assert quantized and all(isinstance(encoder.get_submodule(n), W4A8Linear) for n in ours)
    assert not any(t.is_meta for t in (*encoder.parameters(), *encoder.buffers()))
    twin = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_h3_dir / "text_encoder"), dtype=torch.bfloat16)
    for name, layer in zip(quantized, ours, strict=True):
        linear = twin.get_submodule(layer)
        params = AsymW4A8Int8Layout.Params(
            scale=tensors[f"{name}.weight_s_rel"], s_channel=tensors[f"{name}.weight_s_channel"],
            codebook=tensors.get(f"{name}.weight_codebook"), orig_dtype=torch.bfloat16,
            orig_shape=tuple(linear.weight.shape), group_size=16, convrot_groupsize=16)
        linear.weight = torch.nn.Parameter(
            QuantizedTensor(tensors[f"{name}.weight"], "AsymW4A8Int8Layout", params), requires_grad=False)
    ids = torch.tensor([[3, 7, 11, 2, 9, 1]])
    with torch.inference_mode():
        ours_50 = encoder.model(input_ids=ids, output_hidden_states=True).hidden_states[50]
        twin_50 = twin.model(input_ids=ids, output_hidden_states=True).hidden_states[50]
    assert torch.equal(ours_50, twin_50)


def test_an_int8_convrot_conditioner_file_keeps_int8_and_reads_like_comfy_kitchens_weights(
        h3_pipe, tiny_h3_dir: Path, tmp_path: Path):
    """Comfy-Org's practical H3 text encoder is int8 convrot: through ComfyUI's layout and the
    conditioner's fit (layers renamed, later layers dropped) each layer keeps its int8 weight and
    rotates its input; the hidden state H3 reads is within a bf16 rounding's reach of the folder's
    encoder holding comfy-kitchen's own dequantisation of those layers, and the same bits resident,
    layer-streamed and in leaf groups."""
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    from diffusers_offload.offload_core import Components, Engine, OffloadConfig
    from diffusers_offload.offload_core.formats.convrot import RotatingLinear
    from diffusers_offload.offload_core.formats.fp8 import table_of
    from fixtures.comfy_files import int8_tensors
    from transformers import Qwen3VLForConditionalGeneration

    comfy = comfy_conditioner_state_dict(h3_pipe.text_encoder.to(torch.bfloat16).state_dict(), 50)
    layers = {k: v for k, v in comfy.items() if k.startswith("model.layers.") and v.ndim == 2}
    quantized, _header = int8_tensors(layers, per_row=True, convrot=16)
    path = write({**comfy, **quantized}, tmp_path / "h3_conditioner_int8_convrot.safetensors")
    names = [k.removesuffix(".comfy_quant") for k in quantized if k.endswith(".comfy_quant")]

    encoder = load_conditioner_file(path, tiny_h3_dir / "text_encoder", torch.bfloat16, 50)
    table = table_of(encoder)
    ours = ["model.language_model." + n.removeprefix("model.") for n in names]
    rotating = [n for n in ours if isinstance(encoder.get_submodule(n), RotatingLinear)]
    assert rotating and all(id(encoder.get_submodule(n).weight) in table.weights for n in ours)
    twin = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_h3_dir / "text_encoder"), dtype=torch.bfloat16)
    for name, layer in zip(names, ours, strict=True):
        q, scale = quantized[f"{name}.weight"], quantized[f"{name}.weight_scale"]
        params = TensorWiseINT8Layout.Params(scale=scale, orig_dtype=torch.bfloat16, orig_shape=tuple(q.shape),
                                             convrot=layer in rotating, convrot_groupsize=16)
        twin.get_submodule(layer).weight.data = TensorWiseINT8Layout.dequantize(q, params)
    ids = torch.tensor([[3, 7, 11, 2, 9, 1]])
    with torch.inference_mode():
        twin_50 = twin.model(input_ids=ids, output_hidden_states=True).hidden_states[50].float()
    outs = []
    for mode in ("none", "auto", "leaf"):  # resident, the text encoder's layer stream, leaf groups
        engine, bag = Engine(), Components(text_encoder=encoder)
        engine.place(bag, OffloadConfig(mode=mode, on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu"))
        try:
            with torch.inference_mode():
                outs.append(encoder.model(input_ids=ids, output_hidden_states=True).hidden_states[50].float())
        finally:
            engine.release(bag)
    assert (outs[0] - twin_50).abs().max() < 0.03 * twin_50.abs().max()
    assert all(torch.equal(out, outs[0]) for out in outs[1:])

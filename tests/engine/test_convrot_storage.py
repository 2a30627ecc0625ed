"""ComfyUI int8 convrot files (comfy-kitchen's TensorWiseINT8Layout with ``convrot``: the int8
values of the weight rotated by a block Hadamard matrix, the form Comfy-Org's practical MiniMax-H3
files take), quantized here by comfy-kitchen itself: loaded with their weights kept int8, each
such Linear rotating its input (`formats/convrot.py`); every placement gives the resident model's
output bit for bit, close to the model holding comfy-kitchen's own dequantised weights and far
from one that skips the rotation; weights used otherwise (diffusers' float32 modules, the output
projection, an embedding table) are comfy-kitchen's dequantisation bit for bit; int8 bytes are
what the streamer moves; text encoders keep int8 too; inconsistent files are refused by name."""

import json

import pytest
import torch
import torch.nn.functional as F
from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.convrot import RotatingLinear, rotate_back, rotate_input
from diffusers_offload.offload_core.formats.fp8 import table_of
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.single_file_pipeline import load_text_encoder
from diffusers_offload.offload_core.lora import LoraSpec, activate
from diffusers_offload.offload_core.state import leftovers
from fixtures import comfy_files
from fixtures.comfy_files import comfy_int8_wan_tensors, int8_tensors, write_component_file
from fixtures.lora_reference import lora_deltas
from fixtures.placements import PLACEMENTS, run_placed
from fixtures.quantized import (
    digest,
    encoded,
    int8_reference_transformer,
    refused,
    streamed_in_one_step,
    two_runs_placed,
    wan_pipe,
)
from fixtures.tiny_models import run_wan
from safetensors.torch import load_file, save_file

pytest_plugins = ["fixtures.tiny_loras"]
_comfy_int8_wan = comfy_files.comfy_int8_wan  # the session fixtures, under their own names
_wide_wan_dir = comfy_files.wide_wan_dir
BF16 = torch.bfloat16
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
GROUP = 16  # a power of 4 dividing every width of the wide tiny Wan
RESIDENT = OffloadConfig(mode="none", **BASE)


def _params(q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype):
    return TensorWiseINT8Layout.Params(scale=scale, orig_dtype=dtype, orig_shape=tuple(q.shape),
                                       convrot=True, convrot_groupsize=group)


@pytest.mark.parametrize("group", [4, 16, 64, 256])
def test_the_rotation_is_comfy_kitchens(group):
    """Rotating a weight back gives comfy-kitchen's dequantisation bit for bit; a rotating Linear
    (input rotated, weight as stored) computes what comfy-kitchen's dense weight computes, within
    one bf16 rounding of the input, and what ComfyUI's int8 matmul computes within its activation
    quantisation; without the rotation it is far off."""
    torch.manual_seed(group)
    w = torch.randn(48, 2 * group, dtype=BF16)
    q, params = TensorWiseINT8Layout.quantize(w, is_weight=True, per_channel=True, convrot=True,
                                              convrot_groupsize=group)
    assert torch.equal(rotate_back(q.float() * params.scale, group),
                       TensorWiseINT8Layout.dequantize(q, _params(q, params.scale, group, torch.float32)))
    dense = TensorWiseINT8Layout.dequantize(q, params)  # bf16
    layer = torch.nn.Linear(2 * group, 48, bias=False, dtype=BF16)
    layer.weight.data = (q.float() * params.scale).to(BF16)
    layer.__class__, layer.convrot_group = RotatingLinear, group
    x = torch.randn(5, 2 * group, dtype=BF16)
    out, want = layer(x).float(), F.linear(x, dense).float()
    scale = want.abs().max()
    assert (out - want).abs().max() < 0.02 * scale
    from comfy_kitchen import int8_linear

    comfy = int8_linear(x, q, params.scale, None, out_dtype=BF16, convrot=True, convrot_groupsize=group).float()
    assert (out - comfy).abs().max() < 0.05 * scale
    unrotated = F.linear(x, layer.weight).float()
    assert (unrotated - want).abs().max() > 0.2 * scale
    torch.testing.assert_close(rotate_input(rotate_input(x.double(), group), group), x.double())  # its own inverse


@pytest.fixture(scope="module")
def convrot_file(wide_wan_dir, comfy_int8_wan):
    return comfy_int8_wan(per_row=True, wide=wide_wan_dir, convrot=GROUP)


@pytest.fixture(scope="module")
def outputs(tiny_wan_dir, wide_wan_dir, convrot_file, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The resident convrot model's pipeline output (mode none), and its transformer's forward on
    fixed inputs beside those of comfy-kitchen's dense model and of the model without rotation."""
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(convrot_file, wide_wan_dir, BF16))
    dense = int8_reference_transformer(convrot_file, wide_wan_dir, tmp_path_factory.mktemp("convrot-ref"))
    unrotated = load_denoiser(convrot_file, wide_wan_dir, BF16)
    for layer in unrotated.modules():
        if isinstance(layer, RotatingLinear):
            layer.__class__ = torch.nn.Linear
    return {"resident": run_placed(pipe, RESIDENT), "forward": _forward(pipe),
            "dense": _forward(wan_pipe(tiny_wan_dir, dense)), "unrotated": _forward(wan_pipe(tiny_wan_dir, unrotated))}


def _forward(pipe) -> torch.Tensor:
    """One transformer forward of ``pipe`` placed resident, on inputs fixed by a seed."""
    config = pipe.transformer.config
    gen = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, config.in_channels, 2, 8, 8, generator=gen, dtype=BF16),
                  timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 7, config.text_dim, generator=gen, dtype=BF16))
    engine = Engine()
    engine.place(pipe, RESIDENT)
    try:
        with torch.no_grad():
            return pipe.transformer(**inputs, return_dict=False)[0].float()
    finally:
        engine.release(pipe)


def test_a_convrot_file_computes_comfy_kitchens_model(tiny_wan_dir, wide_wan_dir, convrot_file, outputs):
    """Every stored layer rotates its input; layers decoded at load hold comfy-kitchen's dequantisation
    bit for bit; a forward is within 3 % of the dense model's largest value and over 10 × closer to it
    than the same file without the rotation."""
    model = load_denoiser(convrot_file, wide_wan_dir, BF16)
    table = table_of(model)
    rotating = [n for n, m in model.named_modules() if isinstance(m, RotatingLinear)]
    assert table.int8 and len(rotating) == len(table.weights) > 0  # every stored layer rotates its input
    assert all(m.convrot_group == GROUP for m in model.modules() if isinstance(m, RotatingLinear))
    tensors = load_file(str(convrot_file))

    def dense(layer: str, dtype: torch.dtype) -> torch.Tensor:
        q, s = tensors[f"{layer}.weight"], tensors[f"{layer}.weight_scale"]
        return TensorWiseINT8Layout.dequantize(q, _params(q, s, GROUP, dtype))

    # decoded at load: the output projection (skipped by layerwise casting), an fp32 time embedder layer
    assert torch.equal(model.proj_out.weight, dense("head.head", BF16))
    fp32 = model.condition_embedder.time_embedder.linear_1.weight
    assert fp32.dtype == torch.float32 and torch.equal(fp32, dense("time_embedding.0", BF16).float())
    gap = (outputs["forward"] - outputs["dense"]).abs().max()
    assert gap < 0.1 * (outputs["unrotated"] - outputs["dense"]).abs().max()
    assert gap < 0.03 * outputs["dense"].abs().max()


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_convrot_file_runs_as_resident_in_every_placement(placement, tiny_wan_dir, wide_wan_dir, convrot_file,
                                                           outputs):
    before = digest(convrot_file)
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(convrot_file, wide_wan_dir, BF16))
    model = pipe.transformer
    int8 = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.int8}
    first, second = two_runs_placed(Engine(), pipe, OffloadConfig(**PLACEMENTS[placement], **BASE))
    assert torch.equal(first, outputs["resident"]) and torch.equal(second, outputs["resident"])
    assert leftovers(model) == []
    assert all(torch.equal(p, int8[n]) for n, p in model.named_parameters() if n in int8)
    assert digest(convrot_file) == before


def test_the_streamer_moves_convrot_int8_bytes(tiny_wan_dir, wide_wan_dir, convrot_file, monkeypatch):
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(convrot_file, wide_wan_dir, BF16))
    blocks = sum(p.numel() * p.element_size() for b in pipe.transformer.blocks for p in b.parameters())
    moved, dtypes, report, engine = streamed_in_one_step(pipe, monkeypatch, **BASE)
    assert sum(moved) == 2 * blocks and torch.int8 in dtypes  # one step, two forwards (CFG), storage bytes
    assert report.component("transformer").quantization == "comfy int8_tensorwise convrot"
    engine.release(pipe)


# -- LoRA ------------------------------------------------------------------------------------------

def test_a_lora_on_convrot_layers_is_unfused_on_the_unrotated_input(tiny_wan_dir, comfy_int8_wan, wan_loras):
    """LoRA ``a`` on the tiny Wan's convrot layers (group 4) takes the unfused path: a covered
    layer's output moves by the file's delta applied to its input as given (not the rotated one),
    the streamed run equals the resident one, and clearing the LoRA gives the base bit for bit with
    the int8 bytes unwritten."""
    path = comfy_int8_wan(per_row=True, convrot=4)
    deltas = lora_deltas(wan_loras["a"])
    outs = {}
    for placement in ("none", "auto"):
        pipe = wan_pipe(tiny_wan_dir, load_denoiser(path, tiny_wan_dir, BF16))
        model = pipe.transformer
        stored = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.int8}
        engine = Engine()
        engine.place(pipe, OffloadConfig(**PLACEMENTS[placement], **BASE))
        base = run_wan(pipe)
        activate(pipe, [LoraSpec(str(wan_loras["a"]))])
        outs[placement] = run_wan(pipe)
        lora = engine.report(pipe).component("transformer").details["lora"]
        assert lora["path"] == "unfused" and lora["layers"] == len(deltas)
        if placement == "none":
            name = next(iter(deltas))
            layer = model.get_submodule(name)
            assert isinstance(layer, RotatingLinear)
            x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(2)).to(BF16)
            with torch.no_grad():
                moved = layer(x).float()
                activate(pipe, [])
                moved -= layer(x).float()
            want = x.float() @ deltas[name].T
            assert (moved - want).abs().max() < 0.02 * want.abs().max()
        activate(pipe, [])
        assert torch.equal(run_wan(pipe), base) and not torch.equal(outs[placement], base)
        engine.release(pipe)
        assert leftovers(model) == [] and all(torch.equal(p, stored[n]) for n, p in model.named_parameters()
                                              if n in stored)
    assert torch.equal(outs["auto"], outs["none"])


# -- text encoders ----------------------------------------------------------------------------------

def test_an_int8_convrot_text_encoder_keeps_int8(tiny_wan_dir, tmp_path):
    """The tiny UMT5 as a ComfyUI int8 file (convrot where its widths allow: attention, gated
    input projections, the embedding table; ``wo`` plain per-row int8): its Linear weights stay
    int8, the table is comfy-kitchen's dequantisation, ``wo`` (kept out of storage as T5's float32
    module) decoded, and the pipeline runs in the streamed placements as resident, close to the
    encoder holding comfy-kitchen's dense weights."""
    source = write_component_file(tiny_wan_dir, "text_encoder", tmp_path / "umt5.safetensors")
    tensors, header = int8_tensors(load_file(str(source)), per_row=True, convrot=GROUP)
    path = tmp_path / "umt5-int8-convrot.safetensors"
    save_file(tensors, str(path), metadata=header)
    encoder = load_text_encoder(path, tiny_wan_dir / "text_encoder", "UMT5EncoderModel", BF16)
    table = table_of(encoder)
    assert table.int8 and sum(isinstance(m, RotatingLinear) for m in encoder.modules()) > 0
    wo = "encoder.block.0.layer.1.DenseReluDense.wo"  # plain int8 (width 37), in T5's float32 modules: decoded
    want_wo = (tensors[f"{wo}.weight"].float() * tensors[f"{wo}.weight_scale"]).to(BF16)
    assert torch.equal(encoder.get_submodule(wo).weight, want_wo)
    q, s = tensors["shared.weight"], tensors["shared.weight_scale"]
    assert torch.equal(encoder.shared.weight, TensorWiseINT8Layout.dequantize(q, _params(q, s, GROUP, BF16)))
    dense = {k: v for k, v in tensors.items() if not k.endswith((".weight_scale", ".comfy_quant"))}
    for key in [k for k, v in dense.items() if v.dtype == torch.int8]:
        layer = key.removesuffix(".weight")
        conf = json.loads(bytes(tensors[f"{layer}.comfy_quant"].tolist()))
        scale = tensors[f"{layer}.weight_scale"]
        dense[key] = (TensorWiseINT8Layout.dequantize(dense[key], _params(dense[key], scale, GROUP, BF16))
                      if conf.get("convrot") else (dense[key].float() * scale).to(BF16))
    reference_path = tmp_path / "umt5-dense.safetensors"
    save_file(dense, str(reference_path))
    reference = load_text_encoder(reference_path, tiny_wan_dir / "text_encoder", "UMT5EncoderModel", BF16)
    want, got = (encoded(wan_pipe(tiny_wan_dir, text_encoder=e)) for e in (reference, encoder))
    assert (got - want).abs().max() < 0.03 * want.abs().max() and not torch.equal(got, want)
    resident = run_placed(wan_pipe(tiny_wan_dir, text_encoder=encoder), RESIDENT)
    for placement in ("auto", "leaf", "model"):
        pipe = wan_pipe(tiny_wan_dir, text_encoder=encoder)
        first, _second = two_runs_placed(Engine(), pipe, OffloadConfig(**PLACEMENTS[placement], **BASE))
        assert torch.equal(first, resident), placement
    assert {p.dtype for p in encoder.parameters()} >= {torch.int8}


# -- refused by name, files untouched ---------------------------------------------------------------

@pytest.mark.parametrize("case", ["group", "width", "conv"])
def test_inconsistent_convrot_files_are_refused(case, tiny_wan_dir, tmp_path):
    """A group size that is not a power of 4, one that does not divide the layer's width, a convrot
    entry on a weight that is not a matrix: each refused naming the layer."""
    tensors, header = comfy_int8_wan_tensors(tiny_wan_dir, per_row=True)
    layer = "patch_embedding" if case == "conv" else "blocks.0.self_attn.q"
    group = {"group": 8, "width": 4 ** 5, "conv": 4}[case]
    if case == "conv":
        tensors[f"{layer}.weight_scale"] = torch.ones(tensors[f"{layer}.weight"].shape[0], 1)
        tensors[f"{layer}.weight"] = torch.ones_like(tensors[f"{layer}.weight"], dtype=torch.int8)
    conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}
    tensors[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    path = tmp_path / f"wan-convrot-{case}.safetensors"
    save_file(tensors, str(path), metadata=header)
    why = {"group": "not a power of 4", "width": "not a multiple of its convrot group size",
           "conv": "not a matrix"}[case]
    refused(rf"layer {layer} is declared int8_tensorwise with convrot, but .*{why}", path, tiny_wan_dir)


# -- MiniMax-H3 (Comfy-Org's practical H3 transformer is int8 convrot) ------------------------------

@pytest.fixture(scope="module")
def h3_case(tiny_h3_dir, tmp_path_factory):
    """(the tiny H3 t2va pipeline holding the wide H3 transformer from an int8 convrot file in the
    single-file layout, that transformer, the file's tensors)"""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines import ModularPipeline
    from fixtures.h3_files import build_wide_h3, comfy_h3_state_dict, write

    tmp = tmp_path_factory.mktemp("h3-convrot")
    folder = build_wide_h3(tmp / "h3")
    original = MiniMaxH3Transformer3DModel.from_pretrained(str(folder / "transformer"), torch_dtype=BF16)
    comfy = comfy_h3_state_dict(original.state_dict(), dict(original.config))
    quantized, _header = int8_tensors({k: v for k, v in comfy.items() if k.endswith(".weight") and v.ndim == 2},
                                      per_row=True, convrot=GROUP)
    path = write({**comfy, **quantized}, tmp / "h3-int8-convrot.safetensors")
    loaded = load_denoiser(path, folder, BF16)
    pipe = ModularPipeline.from_pretrained(tiny_h3_dir, workflow="t2va")
    pipe.load_components(dtype=BF16)
    pipe.set_progress_bar_config(disable=True)
    pipe.update_components(transformer=loaded)
    return pipe, loaded, quantized


def test_an_h3_convrot_file_splits_its_fused_layers_by_rows_and_runs_alike_everywhere(h3_case):
    """diffusers' H3 conversion splits the file's fused ``qkv_proj`` into to_q / to_k / to_v (each
    part keeps its rows' int8 values and scales, rotates its input, and computes comfy-kitchen's
    dequantisation of those rows) and swaps the halves of the gated feed-forward's rows (its
    per-row scales follow); the t2va run is the same bits resident and streamed."""
    from fixtures.tiny_models import run_h3

    pipe, loaded, quantized = h3_case
    file_layer = "blocks.0.attn.qkv_proj" if "blocks.0.attn.qkv_proj.weight" in quantized else None
    assert file_layer is not None, sorted(quantized)[:8]
    q, scale = quantized[f"{file_layer}.weight"], quantized[f"{file_layer}.weight_scale"]
    dense = TensorWiseINT8Layout.dequantize(q, _params(q, scale, GROUP, torch.float32))
    rows = q.shape[0] // 3
    table = table_of(loaded)
    for i, part in enumerate(("to_q", "to_k", "to_v")):
        layer = loaded.get_submodule(f"transformer_blocks.0.attn.{part}")
        assert isinstance(layer, RotatingLinear) and layer.weight.dtype == torch.int8
        assert torch.equal(layer.weight, q[i * rows:(i + 1) * rows])
        value = rotate_back(layer.weight.float() * table.int8_scale(layer.weight, layer.weight.device), GROUP)
        assert torch.equal(value, dense[i * rows:(i + 1) * rows]), part
    fq, fs = quantized["blocks.0.mlp.fc1.weight"], quantized["blocks.0.mlp.fc1.weight_scale"]
    half, ff = fq.shape[0] // 2, loaded.get_submodule("transformer_blocks.0.ff.net.0.proj")
    assert torch.equal(ff.weight, torch.cat([fq[half:], fq[:half]]))  # the conversion puts the gate's rows last:
    assert torch.equal(table.int8_scale(ff.weight, ff.weight.device), torch.cat([fs[half:], fs[:half]]))  # scales too
    outs = []
    for placement in (dict(mode="none"), dict(mode="auto"), dict(mode="auto", preload="off")):
        engine = Engine()
        engine.place(pipe, OffloadConfig(**placement, **BASE))
        try:
            out = run_h3(pipe)
        finally:
            engine.release(pipe)
        outs.append(out)
        assert leftovers(loaded) == []
    assert all(torch.equal(o.video, outs[0].video) and torch.equal(o.audio, outs[0].audio) for o in outs[1:])

"""ComfyUI int8_tensorwise single files (comfy-kitchen's TensorWiseINT8Layout, no convrot: that is
`test_convrot_storage.py`): loaded with their weights kept int8 and run, in every placement, bit for
bit like a bf16 model holding ``(q.float() * scale).to(bf16)`` computed here from the file
(comfy-kitchen's ``dequantize_int8_simple_dtype``, written out), with per-tensor and per-row
scales; what the streamer moves and keeps is int8 bytes; a release leaves the int8 weights as
they were; unknown formats are refused by name; no file changes."""

import json

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import table_of
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.state import leftovers
from fixtures import comfy_files
from fixtures.comfy_files import (
    INT8_FORMAT,
    comfy_int8_wan_tensors,
    write_comfy_int8_wan,
)
from fixtures.placements import PLACEMENTS
from fixtures.quantized import (
    digest,
    int8_reference_transformer,
    refused,
    streamed_in_one_step,
    two_runs_placed,
    wan_pipe,
)
from fixtures.tiny_models import run_wan
from safetensors.torch import save_file

_comfy_int8_wan = comfy_files.comfy_int8_wan  # the session fixture, under its own name
BF16 = torch.bfloat16
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
VARIANTS = {
    "per-tensor": dict(per_row=False),
    "per-row": dict(per_row=True),
    "per-row-metadata": dict(per_row=True, metadata=True),
}



@pytest.fixture(scope="module")
def references(tiny_wan_dir, comfy_int8_wan, tmp_path_factory) -> dict[str, torch.Tensor]:
    """variant -> the reference pipeline's output (one per file)."""
    tmp = tmp_path_factory.mktemp("int8-reference")
    return {
        name: run_wan(wan_pipe(tiny_wan_dir, int8_reference_transformer(comfy_int8_wan(**kw), tiny_wan_dir, tmp)))
        for name, kw in VARIANTS.items()
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_int8_file_runs_as_the_dequantised_model_in_every_placement(
    variant, placement, tiny_wan_dir, comfy_int8_wan, references
):
    path = comfy_int8_wan(**VARIANTS[variant])
    before = digest(path)
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(path, tiny_wan_dir, BF16))
    model = pipe.transformer
    table = table_of(model)
    int8 = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.int8}
    assert table.int8 and len(int8) == len(table.weights) > 0  # stored as int8, not upcast
    assert all((s.ndim == 2) == VARIANTS[variant]["per_row"] for s in table.int8_scales.values())
    first, second = two_runs_placed(Engine(), pipe, OffloadConfig(**PLACEMENTS[placement], **BASE))
    assert torch.equal(first, references[variant]) and torch.equal(second, references[variant])
    assert leftovers(model) == []
    for name, p in model.named_parameters():
        if name in int8:
            assert p.dtype == torch.int8 and p.device.type == "cpu" and torch.equal(p, int8[name]), name
    assert digest(path) == before


def test_scales_are_applied_per_row(tiny_wan_dir, comfy_int8_wan, references):
    """A per-row file read with one scale per tensor (its first row's) gives another output: a pack
    that broadcast the scale wrongly or dropped rows fails here."""
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(comfy_int8_wan(per_row=True), tiny_wan_dir, BF16))
    table = table_of(pipe.transformer)
    for key, scale in table.int8_scales.items():
        table.int8_scales[key] = scale[0, 0].clone()
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="none", **BASE))
    try:
        assert not torch.allclose(run_wan(pipe), references["per-row"], atol=1e-3)
    finally:
        engine.release(pipe)


def test_streamer_moves_and_keeps_int8_bytes(tiny_wan_dir, comfy_int8_wan, monkeypatch):
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(comfy_int8_wan(per_row=True), tiny_wan_dir, BF16))
    model = pipe.transformer
    blocks = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
    int8_bytes = sum(p.numel() for b in model.blocks for p in b.parameters() if p.dtype == torch.int8)
    assert int8_bytes > 0.7 * blocks  # the blocks' bytes are mostly int8 weights
    moved, dtypes, report, engine = streamed_in_one_step(pipe, monkeypatch, **BASE)
    assert sum(moved) == 2 * blocks and torch.int8 in dtypes  # one step, two forwards (CFG)
    assert report.component("transformer").quantization == "comfy int8_tensorwise"
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    assert report.component("transformer").nbytes == sum(t.numel() * t.element_size() for t in tensors)
    engine.release(pipe)


# -- refused by name, files untouched ---------------------------------------------------------------

def test_unknown_formats_are_refused_by_name(tiny_wan_dir, tmp_path):
    for fmt in ("awq_w4a16", "int4_magic"):
        path = write_comfy_int8_wan(
            tiny_wan_dir, tmp_path / f"wan-{fmt}.safetensors", layer_conf={"format": fmt}
        )
        err = refused(rf"comfy-kitchen layouts \({fmt}\)", path, tiny_wan_dir)
        assert "int8_tensorwise with or without convrot" in str(err) and "asym_w4a8_int8" in str(err)  # says what runs


def test_inconsistent_int8_files_arerefused(tiny_wan_dir, tmp_path):
    """An int8 weight without its entry or scale, or one whose scale is per column, is refused."""
    tensors, header = comfy_int8_wan_tensors(tiny_wan_dir)
    stray = dict(tensors)
    stray.pop("blocks.0.self_attn.q.comfy_quant")
    path = tmp_path / "wan-int8-stray.safetensors"
    save_file(stray, str(path), metadata=header)
    refused(r"int8 weights \(blocks\.0\.self_attn\.q\.weight\) have no int8_tensorwise", path, tiny_wan_dir)
    unscaled = dict(tensors)
    unscaled.pop("blocks.0.self_attn.q.weight_scale")
    path = tmp_path / "wan-int8-unscaled.safetensors"
    save_file(unscaled, str(path), metadata=header)
    refused(r"blocks\.0\.self_attn\.q is declared int8_tensorwise .* no weight_scale", path, tiny_wan_dir)
    columns = dict(tensors)
    columns["blocks.0.self_attn.q.weight_scale"] = torch.ones(
        1, tensors["blocks.0.self_attn.q.weight"].shape[1]
    )
    path = tmp_path / "wan-int8-columns.safetensors"
    save_file(columns, str(path), metadata=header)
    refused(r"blocks\.0\.attn1\.to_q has shape \(1, \d+\).*per row", path, tiny_wan_dir)
    mixed = {k: v for k, v in tensors.items() if not k.startswith("blocks.1.")}
    mixed |= {
        k: v
        for k, v in comfy_files.comfy_quant_wan_tensors(tiny_wan_dir).items()
        if k.startswith("blocks.1.")
    }
    path = tmp_path / "wan-int8-fp8.safetensors"
    save_file(mixed, str(path), metadata=header)
    refused("mixes int8 and fp8 weights", path, tiny_wan_dir)


def test_metadata_lists_the_layers_as_comfyui_reads_them(comfy_int8_wan):
    """The header variant carries ComfyUI's ``_quantization_metadata`` and no per-layer entry."""
    from safetensors import safe_open

    with safe_open(str(comfy_int8_wan(per_row=True, metadata=True)), framework="pt") as f:
        meta = json.loads(f.metadata()["_quantization_metadata"])
        keys = list(f.keys())
    assert meta["format_version"] == "1.0" and meta["layers"]["blocks.0.self_attn.q"] == {
        "format": INT8_FORMAT
    }
    assert not any(k.endswith(".comfy_quant") for k in keys)

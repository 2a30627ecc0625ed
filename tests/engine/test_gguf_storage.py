"""GGUF single files on every transport: the tiny Wan transformer loaded from a real GGUF file
(diffusers' `from_single_file` + `GGUFQuantizationConfig`: `GGUFParameter` uint8 storage,
`GGUFLinear` dequantizing at compute) and placed in the tiny Wan pipeline.

- every mode and preload policy equals the resident GGUF model bit for bit (the same packed bytes
  reach the same dequantizer: nothing in between may differ);
- every GGUF layer computes from a `GGUFParameter` that kept its quant type, on the onload device
  (leaf mode is diffusers' group offloading, which swaps ``param.data``);
- the GGUF model is within the format's error of the bf16 model (bounds below);
- the streamer moves and the report counts packed bytes; a release leaves nothing of ours and
  every packed weight as it was;
- `inspect_gguf` names a bad file and what it looks like, and refuses quant types diffusers
  cannot dequantize; no file is modified.
Q8_0, Q4_0, Q4_K, Q5_K and Q6_K (see tests/fixtures/gguf_files.py) are all covered.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from diffusers.quantizers.gguf import utils as gguf_utils
from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.components import describe
from diffusers_offload.offload_core.formats.gguf import GgufFileError, inspect_gguf
from diffusers_offload.offload_core.state import DEQUANT_HOOK, REGISTRY, leftovers
from diffusers_offload.offload_core.transport import gguf_kernel
from diffusers_offload.offload_core.transport.gguf_dequant import GgufDequantHook
from diffusers_offload.offload_core.transport.prefetch import Prefetcher
from diffusers_offload.offload_core.transport.streamer import BlockStreamer
from fixtures.gguf_files import (  # noqa: F401  (session fixtures)
    QTYPES,
    WIDE,
    WanGguf,
    dequantized_state_dict,
    load_gguf_wan,
    wan_gguf_fixture,
)
from fixtures.placements import PLACEMENTS
from fixtures.quantized import two_runs_placed
from fixtures.tiny_models import run_wan

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0)
# The onload devices here: the CPU always (same kernels, so bit-exact and fast); an accelerator
# when there is one (real moves, pinned memory, streams: the data swaps that matter).
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
CONFIGS = PLACEMENTS
# Relative L2 error of the denoiser's output against the bf16 model holding the unquantized
# weights. A Q8_0 weight is off by at most half a step of max|block|/127, a 4-bit one by half a step
# of a 16-level grid (Q4_0: max|block|/8; Q4_K: the 32-value sub-block's range/15; IQ4: half a gap
# of its non-linear table, at most 12/127 of the block's largest value), a Q5_K one of range/31, a
# Q6_K one of max|16 values|/31: measured 0.6 % (Q8_0), 2.0 % (Q4_0), 1.8 % (Q4_K), 1.1 % (Q5_K),
# 0.8 % (Q6_K), 2.1 % (IQ4_NL) and 1.9 % (IQ4_XS) on these models (a 256-block file's rows narrower than 256 are in
# its fallback type: Q4_0, Q5_1, Q8_0, IQ4_NL); the bounds allow three to four times that.
BF16_BOUND = {"Q8_0": 0.02, "Q4_0": 0.08, "Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.03, "IQ4_NL": 0.08, "IQ4_XS": 0.08}
_REFERENCE: dict[tuple[str, str], torch.Tensor] = {}


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def packed(model: torch.nn.Module) -> dict[str, tuple[object, tuple[int, ...], torch.Tensor]]:
    """name -> (quant_type, quant_shape, a copy of the packed bytes) for every GGUF weight."""
    return {
        n: (p.quant_type, tuple(p.quant_shape), p.as_tensor().detach().clone())
        for n, p in model.named_parameters()
        if isinstance(p, GGUFParameter)
    }


def resident_output(tiny_wan_dir: Path, file: WanGguf, device: str) -> torch.Tensor:
    """The GGUF pipeline's frames with every component resident on ``device`` (mode none;
    computed once per quant type and device)."""
    key = (file.qtype, device)
    if key not in _REFERENCE:
        pipe = load_gguf_wan(tiny_wan_dir, file)
        engine = Engine()
        engine.place(pipe, OffloadConfig(mode="none", device=device, **BASE))
        _REFERENCE[key] = run_wan(pipe)
        engine.release(pipe)
    return _REFERENCE[key]


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_file_loads_as_packed_gguf_parameters(tiny_wan_dir, wan_gguf, qtype):
    """The fixture is what the other tests need: quantized Linear weights stay packed (uint8,
    the file's quant type) and dequantize to what gguf's own numpy dequantizer reads."""
    file = wan_gguf(qtype)
    info = inspect_gguf(file.file)
    reader = gguf.GGUFReader(str(file.file))
    assert info.arch == "wan" and info.tensor_count == len(reader.tensors)
    assert qtype in info.quantized_types and info.nbytes == sum(int(t.n_bytes) for t in reader.tensors)
    model = load_gguf_wan(tiny_wan_dir, file).transformer
    reference = convert_wan_transformer_to_diffusers(dequantized_state_dict(file.file))
    weights = packed(model)
    assert {q.name for q, _s, _b in weights.values()} == set(info.quantized_types)
    assert any(n.startswith("blocks.") for n in weights), "the blocks hold packed weights"
    for name, (_qt, shape, data) in weights.items():
        assert data.dtype == torch.uint8 and shape == tuple(reference[name].shape), name
        torch.testing.assert_close(
            dequantize_gguf_tensor(dict(model.named_parameters())[name]).float(),
            reference[name],
            rtol=1e-3,
            atol=1e-4,
        )  # diffusers dequantizes in fp16
    described = describe("transformer", model).quantization
    assert described.startswith("gguf ") and set(described.removeprefix("gguf ").split("/")) == set(
        info.quantized_types
    )


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("qtype", QTYPES)
def test_every_mode_equals_the_resident_gguf_model(tiny_wan_dir, wan_gguf, qtype, config, device):
    file = wan_gguf(qtype)
    expected = resident_output(tiny_wan_dir, file, device)
    if device == "cpu" and config == "none":  # mode none on the CPU is the unplaced pipeline
        assert torch.equal(run_wan(load_gguf_wan(tiny_wan_dir, file)), expected)
    pipe = load_gguf_wan(tiny_wan_dir, file)
    before = packed(pipe.transformer)
    first, second = two_runs_placed(Engine(), pipe, OffloadConfig(**CONFIGS[config], device=device, **BASE))
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert leftovers(pipe.transformer) == []
    after = dict(pipe.transformer.named_parameters())
    for name, (qt, shape, data) in before.items():
        p = after[name]
        assert isinstance(p, GGUFParameter) and p.quant_type == qt and tuple(p.quant_shape) == shape, name
        assert p.device.type == "cpu" and p.dtype == torch.uint8 and torch.equal(p.as_tensor(), data), name


# Q4_K (with its Q4_0 fallback rows) on every placement; Q5_K (Q5_1), Q6_K (Q8_0) and IQ4_XS (IQ4_NL)
# on a streamed placement and leaf mode (the transports treat every quant type alike; this keeps the file's time).
LAYER_CASES = [("Q4_K", c) for c in CONFIGS if c != "none"] + [
    (q, c) for q in ("Q5_K", "Q6_K", "IQ4_XS") for c in ("auto", "leaf")
]


@pytest.mark.parametrize(("qtype", "config"), LAYER_CASES)
def test_gguf_layers_compute_from_packed_weights_that_kept_their_quant_type(
    tiny_wan_dir, wan_gguf, qtype, config, device, monkeypatch
):
    """What each GGUFLinear dequantizes while placed: the module's own `GGUFParameter` object,
    uint8, its quant type and shape intact, on the onload device. In leaf mode this is diffusers'
    group offloading swapping ``param.data`` on the parameter (the case that breaks on wrapper
    subclasses); the streamer binds ``param.data`` to views of its buffers."""
    file = wan_gguf(qtype)
    pipe = load_gguf_wan(tiny_wan_dir, file)
    expected = {
        id(p): (p.quant_type, tuple(p.quant_shape))
        for p in pipe.transformer.parameters()
        if isinstance(p, GGUFParameter)
    }
    seen: list[tuple[int, object]] = []
    real, real_kernel = gguf_utils.dequantize_gguf_tensor, gguf_kernel.dequantized

    def check(tensor):
        assert isinstance(tensor, GGUFParameter) and id(tensor) in expected, (
            "a layer computes from another tensor"
        )
        assert (tensor.quant_type, tuple(tensor.quant_shape)) == expected[id(tensor)]
        assert tensor.dtype == torch.uint8 and tensor.device.type == device
        seen.append((id(tensor), tensor.quant_type))

    def watching(tensor):
        check(tensor)
        return real(tensor)

    def kernel_watching(tensor, compute):  # (CUDA: the kernel's hook, `gguf_dequant.py`)
        out = real_kernel(tensor, compute)
        if out is not None:
            check(tensor)
        return out

    monkeypatch.setattr(gguf_utils, "dequantize_gguf_tensor", watching)
    monkeypatch.setattr(gguf_kernel, "dequantized", kernel_watching)
    engine = Engine()
    engine.place(pipe, OffloadConfig(**CONFIGS[config], device=device, **BASE))
    layers = [m for m in pipe.transformer.modules() if isinstance(m, gguf_utils.GGUFLinear)]
    assert layers and all(isinstance(m._diffusers_hook.hooks.get(DEQUANT_HOOK), GgufDequantHook) for m in layers)
    run_wan(pipe, num_inference_steps=1)
    engine.release(pipe)
    assert not any(DEQUANT_HOOK in getattr(vars(m).get(REGISTRY), "hooks", {}) for m in layers)
    assert {i for i, _q in seen} == set(expected), "every GGUF layer ran"
    assert {q.name for _i, q in seen} == {qtype, WIDE[qtype][1]}


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_gguf_model_is_within_the_formats_error_of_the_bf16_model(tiny_wan_dir, wan_gguf, qtype):
    file = wan_gguf(qtype)
    quantized = load_gguf_wan(tiny_wan_dir, file).transformer
    full = WanTransformer3DModel.from_pretrained(
        file.config_dir, subfolder="transformer", dtype=torch.bfloat16
    )
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 3, 8, 8, generator=gen).to(torch.bfloat16)
    text = torch.randn(1, 8, 32, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        got, want = (
            m(latents, torch.tensor([500]), text, return_dict=False)[0].float() for m in (quantized, full)
        )
    error = ((got - want).norm() / want.norm()).item()
    assert 0 < error < BF16_BOUND[qtype], f"{qtype}: relative error {error:.4f}"


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_streamer_moves_and_the_report_counts_packed_bytes(
    tiny_wan_dir, wan_gguf, qtype, device, monkeypatch
):
    pipe = load_gguf_wan(tiny_wan_dir, wan_gguf(qtype))
    model = pipe.transformer
    gguf_ids = {
        id(p): p.numel() for b in model.blocks for p in b.parameters() if isinstance(p, GGUFParameter)
    }
    block_bytes = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
    moved, gguf_moved = [], []
    real_copy = Prefetcher.copy

    def counting(self, pairs, pinned, after):
        pairs = list(pairs)
        if self is not streamer.prefetch:  # another component's streaming (a text encoder's layers)
            return real_copy(self, pairs, pinned, after)
        moved.append(sum(src.numel() * src.element_size() for _dst, src in pairs))
        assert all(dst.dtype == src.dtype for dst, src in pairs), "copies move storage dtypes only"
        gguf_moved.extend((src.dtype, src.numel()) for _dst, src in pairs if isinstance(src, GGUFParameter))
        return real_copy(self, pairs, pinned, after)

    monkeypatch.setattr(Prefetcher, "copy", counting)
    engine = Engine()
    report = engine.place(pipe, OffloadConfig(mode="auto", stream_parts=False, device=device, **BASE))
    streamer = engine.states(pipe)["transformer"].transport
    assert isinstance(streamer, BlockStreamer)
    run_wan(pipe, num_inference_steps=1)
    engine.after_run(pipe)
    forwards = 2  # one step, classifier-free guidance: two transformer forwards
    blocks = len(model.blocks)  # the tiny Wan's blocks share one layout
    assert set(moved) == {block_bytes // blocks}, "each copy is one block's stored bytes"
    # Without a side stream, exactly the run's copies; with one (an accelerator), the prefetch
    # also fills buffers for a next forward that never comes (after_run drops them): at most a ring.
    extra = len(moved) - forwards * blocks
    assert extra == 0 if streamer.prefetch.copy_stream is None else 0 <= extra <= streamer.ring.capacity
    one_block = [n for p_id, n in gguf_ids.items() if p_id in {id(p) for p in model.blocks[0].parameters()}]
    assert one_block and sorted(n for _d, n in gguf_moved) == sorted(len(moved) * one_block)
    assert {d for d, _n in gguf_moved} == {torch.uint8}
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    component = report.component("transformer")
    assert component.nbytes == sum(t.numel() * t.element_size() for t in tensors)
    assert component.quantization.startswith("gguf ") and qtype in component.quantization
    engine.release(pipe)


# -- bad files -------------------------------------------------------------------------------------
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cut(src: Path, out: Path, keep: int) -> Path:
    out.write_bytes(src.read_bytes()[:keep])
    return out


def test_a_truncated_or_garbage_file_is_refused_naming_it(wan_gguf, tiny_wan_dir, tmp_path):
    good = wan_gguf("Q8_0").file
    size = good.stat().st_size
    safetensors = next((tiny_wan_dir / "transformer").glob("*.safetensors"))
    cases = {
        _cut(good, tmp_path / "cut-in-data.gguf", size - 100): "truncated",
        _cut(good, tmp_path / "cut-in-header.gguf", 3000): "truncated",
        _cut(good, tmp_path / "cut-at-magic.gguf", 2): "empty|not a GGUF",
        (tmp_path / "noise.gguf"): "not a GGUF file: it looks like none of the weight formats",
        (tmp_path / "empty.gguf"): "not a GGUF file: it looks like an empty file",
        _cut(
            safetensors, tmp_path / "renamed.gguf", safetensors.stat().st_size
        ): "looks like a safetensors file",
    }
    (tmp_path / "noise.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    (tmp_path / "empty.gguf").write_bytes(b"")
    digests = {p: _digest(p) for p in cases}
    for path, what in cases.items():
        with pytest.raises(GgufFileError, match=f"{path.name}.*({what})") as caught:
            inspect_gguf(path)
        assert isinstance(caught.value, ValueError) and str(path) in str(caught.value)
        assert _digest(path) == digests[path], f"{path.name} was modified"
    with pytest.raises(GgufFileError, match="no such file"):
        inspect_gguf(tmp_path / "missing.gguf")


def test_a_quant_type_diffusers_cannot_dequantize_is_refused_by_name(tmp_path):
    path = tmp_path / "iq2.gguf"
    writer = gguf.GGUFWriter(str(path), arch="wan")
    _block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS]
    writer.add_tensor(
        "blocks.0.ffn.2.weight",
        np.random.default_rng(0).integers(0, 255, (24, size), dtype=np.uint8),
        raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS,
    )
    writer.add_tensor("blocks.0.norm3.weight", np.ones(24, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GgufFileError,
        match=r"iq2\.gguf holds quant type\(s\) IQ2_XXS that diffusers cannot "
        r"dequantize \(1 tensors, e\.g\. blocks\.0\.ffn\.2\.weight\)",
    ):
        inspect_gguf(path)


IMPORT_ALL_WITHOUT_GGUF = """
import importlib, importlib.util, pkgutil, sys
sys.modules["gguf"] = None  # as if the gguf package were not installed
root = sys.argv[1]
spec = importlib.util.spec_from_file_location("diffusers_offload", root + "/__init__.py",
                                              submodule_search_locations=[root])
sys.modules["diffusers_offload"] = importlib.util.module_from_spec(spec)
core = importlib.import_module("diffusers_offload.offload_core")
names = [m.name for m in pkgutil.walk_packages(core.__path__, "diffusers_offload.offload_core.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def test_the_engine_imports_without_the_gguf_package():
    """Only GGUF files need ``gguf`` (diffusers' GGUF module imports it unconditionally): every
    engine module imports without it, so a broken install loses GGUF files, not the whole pack."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL_WITHOUT_GGUF, str(root)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 50

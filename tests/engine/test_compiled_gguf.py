"""GGUF blocks compiled (``compile_blocks``, `transport/gguf_twin.py`), on the CPU with torch.compile's
``aot_eager`` backend (the same tracing, no code generation; tests/gpu compiles with inductor): a
block of diffusers' GGUF layers runs compiled wherever its weights are bound at its entry, its
layers dequantising their packed bytes inside the graph to the eager layers' bits; the twin views
no weight bytes between calls; compiled by inductor (where a C++ compiler is there) they compute
the file's exact values; layers computing through diffusers' optional CUDA kernels keep their
block eager."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from diffusers.quantizers.gguf import utils as gguf_utils
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from diffusers_offload.offload_core.transport import compiled
from fixtures import flux_files
from fixtures.compiling import BASE, PLACEMENTS, aot_eager, two_runs  # noqa: F401  (autouse fixture)
from fixtures.gguf_files import (  # noqa: F401  (session fixture)
    QTYPES,
    WanGguf,
    exactly_dequantised,
    load_gguf_wan,
    wan_gguf_fixture,
    wide_ffn_wan_dir,
    write_wan_gguf,
)
from fixtures.tiny_models import run_flux
from torch._dynamo.utils import counters

_bfl_flux, _flux_tiny_width = flux_files.bfl_flux, flux_files.flux_tiny_width  # fixtures, under their names


def _packed(model: torch.nn.Module) -> dict[str, tuple[object, torch.Tensor]]:
    return {n: (p.quant_type, p.as_tensor().clone()) for n, p in model.named_parameters() if hasattr(p, "quant_type")}


def _runs(pipe, config: OffloadConfig) -> tuple[torch.Tensor, dict, list[torch.Tensor]]:
    """Two runs placed (`two_runs`), with the weights the compiled twins' GGUF layers hold after them."""
    def held(streamer) -> list[torch.Tensor]:
        twins = [f.twin for f in streamer.compiled._forwards.values() if f is not None]
        return [m._parameters["weight"] for t in twins for m in t.modules() if "gguf_source" in vars(m)]

    return two_runs(pipe, config, held)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_blocks_dequantise_inside_the_compiled_forward(tiny_wan_dir, wan_gguf, qtype, placement) -> None:
    """(The tiny Wan's GGUF layer in each block is its ``ffn.2``, the only width a quant block tiles.)"""
    file = wan_gguf(qtype)
    config = OffloadConfig(**BASE, **PLACEMENTS[placement])
    eager, eager_details, _ = _runs(load_gguf_wan(tiny_wan_dir, file), config.replace(compile_blocks=False))
    pipe = load_gguf_wan(tiny_wan_dir, file)
    before = _packed(pipe.transformer)
    out, details, held = _runs(pipe, config)
    assert eager_details["compiled_calls"] == 0
    assert details["compiled_calls"] == details["block_calls"] > 0  # every block's every call
    assert counters["stats"]["unique_graphs"] == 1  # one graph for every block, the packed bytes swapped under it
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert held and all(w.numel() == 0 for w in held)  # between calls a twin views no weight bytes
    after = _packed(pipe.transformer)  # the packed weights are left as they were
    assert after.keys() == before.keys() and len(before) > 0
    assert all(after[n][0] == q and torch.equal(after[n][1], b) for n, (q, b) in before.items())


def test_gguf_layers_on_diffusers_cuda_kernels_keep_their_block_eager(tiny_wan_dir, wan_gguf, monkeypatch,
                                                                      caplog) -> None:
    """With ``DIFFUSERS_GGUF_CUDA_KERNELS`` diffusers computes GGUF layers by its downloaded kernels
    (on CUDA inputs), which a twin would replace by torch's dequantisation: those blocks stay eager."""
    file = wan_gguf("Q8_0")
    config = OffloadConfig(**BASE, preload="1000")
    eager, _, _ = _runs(load_gguf_wan(tiny_wan_dir, file), config.replace(compile_blocks=False))
    monkeypatch.setattr(gguf_utils, "ops", object())  # as if the kernels were loaded (CPU inputs never use them)
    with caplog.at_level(logging.INFO, logger="diffusers_offload"):
        out, details, _ = _runs(load_gguf_wan(tiny_wan_dir, file), config)
    assert details["compiled_calls"] == 0 and details["compiled_blocks"] == 0
    assert "runs eagerly, not compiled: GGUFParameter weight ffn.net.2.weight" in caplog.text
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_blocks_mixing_quant_types_compile_once_per_mix(tiny_wan_dir, tmp_path) -> None:
    """city96's K-quant rules give a few blocks other types (Q4_K_S: the first blocks' attention
    values in Q5_K; Q3_K_M alike): a block class compiles once per mix of its layers' types, and
    every block of every mix still runs compiled, to the eager bits."""
    config_dir = wide_ffn_wan_dir(tiny_wan_dir, tmp_path / "wide")
    file = WanGguf(write_wan_gguf(config_dir, tmp_path / "mixed.gguf", "Q4_K", by_block={0: "Q6_K"}), config_dir,
                   "Q4_K")
    config = OffloadConfig(**BASE, **PLACEMENTS["whole blocks streamed"])
    pipe = load_gguf_wan(tiny_wan_dir, file)
    types = {i: {p.quant_type.name for p in b.parameters() if hasattr(p, "quant_type")}
             for i, b in enumerate(pipe.transformer.blocks)}
    assert types[0] == {"Q6_K"} and all(t == {"Q4_K"} for i, t in types.items() if i)
    eager, _, _ = _runs(load_gguf_wan(tiny_wan_dir, file), config.replace(compile_blocks=False))
    out, details, _ = _runs(pipe, config)
    assert details["compiled_calls"] == details["block_calls"] > 0
    assert counters["stats"]["unique_graphs"] == 2
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU code needs a C++ compiler")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_inductor_compiles_gguf_blocks_to_the_files_exact_values(tiny_wan_dir, wan_gguf, qtype, monkeypatch) -> None:
    """Inductor rounds each dequantised weight once, to what the `gguf` package's dequantiser gives
    (diffusers' eager layers round through fp16 first): the blocks compute as a model whose blocks
    hold those exact values in bf16, bit for bit (streamed whole, so the bytes move under the graph)."""
    monkeypatch.setattr(compiled, "BACKEND", "inductor")
    file = wan_gguf(qtype)
    config = OffloadConfig(**BASE, **PLACEMENTS["whole blocks streamed"])
    exact_pipe = load_gguf_wan(tiny_wan_dir, file)
    exactly_dequantised(exact_pipe.transformer.blocks)  # the non-block part stays diffusers' eager layers
    exact, exact_details, _ = _runs(exact_pipe, config)
    out, details, _ = _runs(load_gguf_wan(tiny_wan_dir, file), config)
    assert details["compiled_calls"] == details["block_calls"] == exact_details["compiled_calls"] > 0
    torch.testing.assert_close(out, exact, rtol=0, atol=0)


@pytest.mark.usefixtures("flux_tiny_width")
def test_flux_gguf_blocks_compile_to_the_eager_output(bfl_flux, tiny_flux_dir) -> None:
    """A city96-style Flux GGUF file: both block classes compile, their projections split from
    BFL's fused GGUF matrices included, to the eager output."""
    path = bfl_flux("Q8_0")
    outs, compiled_blocks = [], []
    for on in (False, True):
        pipe = load_pipeline_with_denoiser(tiny_flux_dir, path, torch.bfloat16)
        engine = Engine()
        engine.place(pipe, OffloadConfig(**BASE, preload="1000").replace(compile_blocks=on))
        try:
            outs.append(run_flux(pipe))
            details = engine.states(pipe)["transformer"].transport.details()
            compiled_blocks.append((details["compiled_blocks"], details["blocks"]))
        finally:
            engine.release(pipe)
    assert compiled_blocks[0][0] == 0 and compiled_blocks[1][0] == compiled_blocks[1][1] > 0
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)

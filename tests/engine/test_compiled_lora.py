"""Unfused LoRAs in compiled blocks (``compile_blocks``, `transport/lora_twin.py`), on the CPU with
torch.compile's ``aot_eager`` backend: a LoRA on quantized layers (fp8, fp8 matmuls, int8, GGUF: the
unfused path, a hook per layer) no longer keeps the blocks eager; every block's every call runs
compiled, to the bits of the eager hooks, with the LoRA on and after it comes off; a model whose
variants reach dynamo's limit compiles afresh."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import store_fp8
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.lora import LoraSpec, activate
from fixtures import comfy_files
from fixtures.compiling import BASE, PLACEMENTS, aot_eager  # noqa: F401  (autouse fixture)
from fixtures.fp8_matmul import wide_wan
from fixtures.gguf_files import load_gguf_wan, wan_gguf_fixture  # noqa: F401  (session fixture)
from fixtures.quantized import wan_pipe as with_transformer
from fixtures.tiny_loras import wan_lora
from fixtures.tiny_models import load_wan, run_wan
from torch._dynamo.utils import counters

pytest_plugins = ["fixtures.tiny_loras"]
_comfy_int8_wan = comfy_files.comfy_int8_wan  # the session fixture, under its own name


def _fp8(tiny_wan_dir: Path):
    pipe = load_wan(tiny_wan_dir)
    pipe.transformer.to(torch.bfloat16)
    store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16)
    return pipe


def _with_and_without(pipe, config: OffloadConfig, lora: Path) -> tuple[list[torch.Tensor], list[int], int, str]:
    """A run with ``lora``, then one after it came off: both outputs, the compiled calls and the
    blocks' forwards of each run, and the LoRA path the report gives for the first."""
    engine = Engine()
    engine.place(pipe, config)
    streamer = engine.states(pipe)["transformer"].transport
    forwards = []
    handle = pipe.transformer.register_forward_pre_hook(lambda *_: forwards.append(1))
    outs, calls = [], []
    try:
        for loras in ([LoraSpec(str(lora))], []):
            before = streamer.details()["compiled_calls"]
            activate(pipe, loras)
            outs.append(run_wan(pipe))
            if loras:
                path = engine.report(pipe).component("transformer").details["lora"]["path"]
            engine.after_run(pipe)
            calls.append(streamer.details()["compiled_calls"] - before)
        return outs, calls, len(forwards) * streamer.details()["blocks"] // 2, path
    finally:
        handle.remove()
        activate(pipe, [])
        engine.release(pipe)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("storage", ["fp8", "fp8 matmuls", "int8", "int8 convrot", "gguf"])
def test_unfused_loras_run_inside_the_compiled_forward(tiny_wan_dir, wan_gguf, comfy_int8_wan, wan_loras, tmp_path,
                                                       storage, placement) -> None:
    """(fp8, int8 (convrot: group 4): LoRA ``a`` on every attention projection, all unfused; GGUF
    Q8_0: a LoRA on ``to_q``, ``to_k`` (float in the file: fused) and ``ffn.net.2`` (Q8_0: unfused).)"""
    if storage.startswith("int8"):
        file = comfy_int8_wan(per_row=True, convrot=4 if storage == "int8 convrot" else 0)
        load = lambda: with_transformer(tiny_wan_dir, load_denoiser(file, tiny_wan_dir, torch.bfloat16))  # noqa: E731
        lora, path = wan_loras["a"], "unfused"
    elif storage == "gguf":
        load = lambda: load_gguf_wan(tiny_wan_dir, wan_gguf("Q8_0"))  # noqa: E731
        lora = wan_lora(load_wan(tiny_wan_dir).transformer, tmp_path, seed=5, targets=("to_q", "to_k", "ffn.net.2"))
        path = "fused+unfused"
    else:
        load = (lambda: wide_wan(tiny_wan_dir)) if storage == "fp8 matmuls" else (lambda: _fp8(tiny_wan_dir))  # noqa: E731
        lora, path = wan_loras["a"], "unfused"
        if storage == "fp8 matmuls":  # the wide transformer's widths: a LoRA of its own
            lora = wan_lora(wide_wan(tiny_wan_dir).transformer, tmp_path, seed=6, targets=("to_q", "to_out.0"))
    config = OffloadConfig(**BASE, **PLACEMENTS[placement])
    eager, eager_calls, _, _ = _with_and_without(load(), config.replace(compile_blocks=False), lora)
    outs, calls, block_calls, got_path = _with_and_without(load(), config, lora)
    assert got_path == path
    assert eager_calls == [0, 0] and calls == [block_calls, block_calls] and block_calls > 0
    assert not torch.equal(outs[0], outs[1])  # the LoRA moved the output
    torch.testing.assert_close(outs[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(outs[1], eager[1], rtol=0, atol=0)


def _off_on_off(pipe, config: OffloadConfig, lora: Path) -> tuple[list[torch.Tensor], list[int]]:
    """Runs without ``lora``, with it, without it: the outputs and dynamo's graph count after each."""
    engine = Engine()
    engine.place(pipe, config)
    outs, graphs = [], []
    try:
        for loras in ([], [LoraSpec(str(lora))], []):
            activate(pipe, loras)
            outs.append(run_wan(pipe))
            engine.after_run(pipe)
            graphs.append(counters["stats"]["unique_graphs"])
        return outs, graphs
    finally:
        activate(pipe, [])
        engine.release(pipe)


def test_a_models_variants_at_torchs_limit_compile_afresh(tiny_wan_dir, wan_loras, caplog) -> None:
    """With dynamo allowed one compiled variant per code object, the fp8 model's blocks without
    the LoRA, with it (a twin of another structure) and without it again each compile (the
    model's code made afresh at the limit, said once each time) to the eager bits, instead of
    running eagerly past the limit."""
    config = OffloadConfig(**BASE, preload="1000")
    with torch._dynamo.config.patch(recompile_limit=1):
        eager, _ = _off_on_off(_fp8(tiny_wan_dir), config.replace(compile_blocks=False), wan_loras["a"])
        with caplog.at_level(logging.INFO, logger="diffusers_offload"):
            outs, graphs = _off_on_off(_fp8(tiny_wan_dir), config, wan_loras["a"])
    assert graphs == [1, 2, 3]
    assert sum("reached torch's recompile_limit: compiling afresh" in r.getMessage() for r in caplog.records) == 2
    for out, want in zip(outs, eager, strict=True):
        torch.testing.assert_close(out, want, rtol=0, atol=0)

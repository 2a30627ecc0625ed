"""Compiled blocks (``compile_blocks``) on a CUDA device, compiled by inductor: every block kept
or streamed whole runs its compiled forward, graphed or not the outputs are the same bits, and
they are within the compiler's rounding of the uncompiled outputs, fp8 and int8 storage, fp8
matmuls and ComfyUI's stored layers (W4A8, W4A4, NVFP4, MXFP8) included; GGUF blocks compute the
file's exact values. Run on the GPU machine (bench/gpu_batch.sh row ``gputests``)."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import dequantize_int8, store_fp8, table_of
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.lora import LoraSpec, activate
from diffusers_offload.offload_core.state import FP8, LORA_HOOK
from fixtures import comfy_files
from fixtures.compiling import STORED_FORMATS, stored_file
from fixtures.fp8_matmul import REL_L2, wide_wan
from fixtures.gguf_files import exactly_dequantised, load_gguf_wan, wan_gguf_fixture  # noqa: F401  (session fixture)
from fixtures.graph_runs import keep_first_after, placed_runs
from fixtures.quantized import wan_pipe as with_transformer
from fixtures.tiny_models import load_bf16, run_wan
from fixtures.tiny_pipes import load_wan
from torch.utils._pytree import tree_map

pytest_plugins = ["fixtures.tiny_loras"]
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's GPU kernels need a CUDA device")
_comfy_int8_wan = comfy_files.comfy_int8_wan  # the session fixtures, under their own names
_wide_wan_dir = comfy_files.wide_wan_dir
BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="1000", compile_blocks=True)


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _decoded(pipe):
    """``pipe`` with each int8 weight of its transformer replaced by its compute value
    (`fp8.dequantize_int8`, the streamer's own cast) and no table left: a bf16 model."""
    table = table_of(pipe.transformer)
    for module in pipe.transformer.modules():
        weight = module._parameters.get("weight")
        if weight is not None and id(weight) in table.weights:
            value = dequantize_int8(weight.data, table.int8_scale(weight, weight.device), torch.bfloat16)
            module.weight = torch.nn.Parameter(value, requires_grad=False)
    FP8.pop(pipe.transformer)
    return pipe


def _int8(path, wide_dir, files, per_row: bool = True, convrot: int = 0):
    """The tiny Wan with the wide transformer from its ComfyUI int8_tensorwise file (``convrot``: its
    layers rotated in groups of that size, each rotating its input)."""
    file = files(per_row=per_row, wide=wide_dir, convrot=convrot)
    return with_transformer(path, load_denoiser(file, wide_dir, torch.bfloat16))


def _fp8(path):
    pipe = load_bf16(path)
    store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16)
    return pipe


@pytest.mark.parametrize("storage", ["model dtype", "fp8", "fp8 matmuls", "fp8 scaled matmuls", "int8", "int8 convrot"])
@pytest.mark.parametrize("plan", ["every block kept", "block 0 kept, the others streamed whole"])
def test_compiled_blocks_graphed_equal_them_eager_and_round_like_the_compiler(tiny_wan_dir, wide_wan_dir, comfy_int8_wan,
                                                                              plan: str, storage: str) -> None:
    """(fp8: kept blocks in parts dequantise inside the compiled graph; blocks streamed whole are cast
    as they bind, inside their capture. fp8 matmuls: ``_scaled_mm`` inside the graph. int8: a
    ComfyUI int8_tensorwise file of the wide tiny Wan (its kept blocks in parts), per-row scales,
    dequantised inside the graph, to the bits of a
    bf16 model holding the int8 weights' compute values compiled alike; against its uncompiled
    run the compiler's rounding moves the tiny model's frames by 4.2 % (each compiled block is as
    close to its float32 value as the eager one: run 47), so that run is no reference for it.
    int8 convrot: the same, each layer rotating its input in the graph; its reference rotates too.)"""
    streamed: list[int] = []
    between = keep_first_after(streamed) if plan.startswith("block 0") else None
    extra = {"stream_parts": False} if between else {}
    load = {"fp8": _fp8, "fp8 matmuls": wide_wan, "fp8 scaled matmuls": lambda p: wide_wan(p, scaled=True),
            "int8": lambda p: _int8(p, wide_wan_dir, comfy_int8_wan),
            "int8 convrot": lambda p: _int8(p, wide_wan_dir, comfy_int8_wan, convrot=16),
            }.get(storage, load_wan)
    if storage.startswith("int8"):  # the reference: a bf16 model holding the int8 weights' compute values, compiled alike
        plain, _ = placed_runs(_decoded(load(tiny_wan_dir)), OffloadConfig(**BASE, **extra), runs=4, between=between)
    else:
        plain, _ = placed_runs(load(tiny_wan_dir), OffloadConfig(**BASE, **extra).replace(compile_blocks=False),
                               runs=4, between=between)
    eager, off = placed_runs(load(tiny_wan_dir), OffloadConfig(**BASE, **extra, cuda_graphs=False), runs=4,
                             between=between)
    graphed, on = placed_runs(load(tiny_wan_dir), OffloadConfig(**BASE, **extra), runs=4, between=between)
    assert off["compiled_calls"] > 0 and on["compiled_calls"] > 0 and on["graphs"] > 0 and on["graphs_refused"] == 0
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))
    # fp8 matmuls round their inputs to fp8 (steps of 6 %): the compiler's rounding upstream moves
    # some across a step, so the bound is the format's own error against bf16 compute
    bound = REL_L2 if "matmuls" in storage else 2e-2
    if storage.startswith("int8"):  # the same values, compiled alike
        assert all(torch.equal(a, b) for a, b in zip(eager, plain, strict=True))
    else:
        assert max(_close(a, b) for a, b in zip(eager, plain, strict=True)) < bound


@pytest.mark.parametrize("fmt", [f for f in STORED_FORMATS if f != "w4a8"])
def test_stored_layers_compiled_graphed_equal_them_eager_and_round_like_the_compiler(tiny_wan_dir, wide_wan_dir,
                                                                                     tmp_path, fmt: str) -> None:
    """ComfyUI's stored layers (`stored_linear`: each kernel one opaque op in the compiled graph) in
    blocks inductor compiled, every block kept: graphed or not the same bits, within the compiler's
    rounding of the uncompiled run (on the CPU, traced alone, they gave its bits). Not W4A8:
    comfy-kitchen's CUDA kernel takes rotation groups of 256 only, wider than the tiny models'
    layers (bench row ``storedcompiled`` runs Wan-14B's W4A8 blocks compiled)."""
    file, folder = stored_file(fmt, tiny_wan_dir, wide_wan_dir, tmp_path)
    load = lambda: with_transformer(tiny_wan_dir, load_denoiser(file, folder, torch.bfloat16))  # noqa: E731
    plain, _ = placed_runs(load(), OffloadConfig(**BASE).replace(compile_blocks=False), runs=4)
    eager, off = placed_runs(load(), OffloadConfig(**BASE, cuda_graphs=False), runs=4)
    graphed, on = placed_runs(load(), OffloadConfig(**BASE), runs=4)
    assert off["compiled_calls"] > 0 and on["compiled_calls"] > 0 and on["graphs"] > 0 and on["graphs_refused"] == 0
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))
    assert max(_close(a, b) for a, b in zip(eager, plain, strict=True)) < 5e-2  # (inductor: W4A4 3.2 %, MXFP8 4.6 %, run 52)


def _first_block_calls(pipe, config: OffloadConfig) -> list[tuple]:
    """Each block's first call in one placed run: (args, kwargs, output), on the CPU in float32."""
    seen: dict[int, tuple] = {}

    def keep(i, args, kwargs, out):
        as32 = lambda t: t.detach().float().cpu() if torch.is_tensor(t) else t  # noqa: E731
        seen.setdefault(i, tree_map(as32, (args, kwargs, out if torch.is_tensor(out) else out[0])))

    handles = [b.register_forward_hook(lambda m, a, k, o, i=i: keep(i, a, k, o), with_kwargs=True)
               for i, b in enumerate(pipe.transformer.blocks)]
    try:
        placed_runs(pipe, config, runs=1)
    finally:
        for handle in handles:
            handle.remove()
    return [seen[i] for i in sorted(seen)]


@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "per-tensor"])
def test_compiled_int8_blocks_are_as_close_to_float32_as_eager_ones(tiny_wan_dir, wide_wan_dir, comfy_int8_wan,
                                                                    per_row) -> None:
    """Each int8 block, fed its own inputs, against the same block in float32 holding the int8
    weights' compute values: compiled it is as close as uncompiled (both bf16 rounding: ~0.3 %), so
    the tiny model's frames moving 4 % between the two is the compiler's rounding, compounded."""
    load = lambda: _int8(tiny_wan_dir, wide_wan_dir, comfy_int8_wan, per_row)  # noqa: E731
    reference = _decoded(load()).transformer.float().cpu().blocks
    config = OffloadConfig(**BASE, cuda_graphs=False)
    errors = {}
    for name, run in {"compiled": config, "eager": config.replace(compile_blocks=False)}.items():
        calls = _first_block_calls(load(), run)
        with torch.no_grad():
            errors[name] = [_close(out, reference[i](*args, **kwargs)) for i, (args, kwargs, out) in enumerate(calls)]
    assert len(errors["compiled"]) == len(reference) > 1
    assert max(errors["compiled"]) < 5e-3 and max(errors["eager"]) < 5e-3
    assert sum(errors["compiled"]) < 1.25 * sum(errors["eager"])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("plan", ["every block kept", "block 0 kept, the others streamed whole"])
def test_gguf_blocks_compiled_compute_the_files_exact_values(tiny_wan_dir, wan_gguf, plan: str, qtype: str) -> None:
    """GGUF layers dequantise inside the compiled graph (`gguf_twin.py`), graphed or not to the same
    bits; inductor rounds each weight once, to the values the `gguf` package's own dequantiser
    gives (diffusers' eager layers round through fp16 first, a bf16 step off in places), so the
    outputs are within the compiler's rounding of the model whose blocks hold those exact values
    (on the CPU, inductor gave the same bits). On the CPU the tiny Q8_0 model's frames moved by ~1 %
    for those one-step differences alone and 4.5 % with the compiler's other rounding (1.2 % on a
    bf16 model), so the uncompiled GGUF output is no reference here."""
    streamed: list[int] = []
    between = keep_first_after(streamed) if plan.startswith("block 0") else None
    extra = {"stream_parts": False} if between else {}
    file = wan_gguf(qtype)
    exact_pipe = load_gguf_wan(tiny_wan_dir, file)
    exactly_dequantised(exact_pipe.transformer.blocks)  # the non-block part stays diffusers' eager GGUF layers
    exact, _ = placed_runs(exact_pipe, OffloadConfig(**BASE, **extra), runs=4, between=between)
    eager, off = placed_runs(load_gguf_wan(tiny_wan_dir, file), OffloadConfig(**BASE, **extra, cuda_graphs=False),
                             runs=4, between=between)
    graphed, on = placed_runs(load_gguf_wan(tiny_wan_dir, file), OffloadConfig(**BASE, **extra), runs=4,
                              between=between)
    assert off["compiled_calls"] > 0 and on["compiled_calls"] > 0
    # diffusers' K-quant dequantisers make small index tensors on the host at each call, which a CUDA
    # graph capture refuses: those blocks run compiled, not graphed (run 46); Q8_0's are graphed
    assert (on["graphs"] > 0) == (qtype == "Q8_0")
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))
    assert max(_close(a, b) for a, b in zip(graphed, exact, strict=True)) < 2e-2


def _lora_runs(tiny_wan_dir, lora, compile_blocks: bool) -> tuple[list[torch.Tensor], dict, set[int], int]:
    """Three runs of the fp8 tiny Wan with ``lora`` (unfused), every block kept: the outputs, the
    streamer's details, the ids of every LoRA hook's device factors after each run, the hooks."""
    pipe = _fp8(tiny_wan_dir)
    engine = Engine()
    engine.place(pipe, OffloadConfig(**BASE).replace(compile_blocks=compile_blocks))
    activate(pipe, [LoraSpec(str(lora))])
    hooks = [vars(m)["_diffusers_hook"].hooks[LORA_HOOK] for m in pipe.transformer.modules()
             if LORA_HOOK in getattr(vars(m).get("_diffusers_hook"), "hooks", {})]
    outs, copies = [], set()
    try:
        for _ in range(3):
            outs.append(run_wan(pipe).cpu())
            engine.after_run(pipe)
            copies |= {id(t) for h in hooks for t in h._resident[2] if t is not None}
        return outs, engine.states(pipe)["transformer"].transport.details(), copies, len(hooks)
    finally:
        activate(pipe, [])
        engine.release(pipe)


def test_an_unfused_lora_runs_inside_the_compiled_blocks_from_the_hooks_copies(tiny_wan_dir, wan_loras) -> None:
    """A LoRA on fp8 layers (a hook each) no longer keeps the blocks eager: they run compiled and
    graphed, within the compiler's rounding of the eager hooks, and the twins compute from the
    hooks' own device copies of the factors (made once: none is copied again run after run)."""
    eager, _, _, _ = _lora_runs(tiny_wan_dir, wan_loras["a"], compile_blocks=False)
    outs, details, copies, hooks = _lora_runs(tiny_wan_dir, wan_loras["a"], compile_blocks=True)
    assert details["compiled_calls"] > 0 and details["compiled_blocks"] == details["blocks"]
    assert details["graphs"] > 0 and details["graphs_refused"] == 0
    assert hooks > 0 and len(copies) == 2 * hooks  # down and up per layer, the same tensors every run
    assert max(_close(a, b) for a, b in zip(outs, eager, strict=True)) < 2e-2

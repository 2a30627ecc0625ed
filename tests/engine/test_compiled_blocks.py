"""Compiled blocks (``compile_blocks``, `transport/compiled.py`), on the CPU with torch.compile's
``aot_eager`` backend (the same tracing, no code generation; the GPU tests compile with inductor):
the compiled forward runs wherever a block's weights are all bound at its entry (kept, streamed
whole, or its parts bound whole) and gives the eager output bit for bit, once compiled for every
block, in each family; fp8 and int8 layers dequantise inside it, to the streamer's bits;
a hook someone else put on a layer keeps its block eager; a compiler that cannot run turns
compiling off; a weight write and a release drop the twins; each model compiles its own variants."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import mark_fp8, store_fp8
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.transport import compiled
from fixtures import comfy_files
from fixtures.compiling import BASE, PLACEMENTS, aot_eager  # noqa: F401  (autouse fixture)
from fixtures.fp8_matmul import wide_wan
from fixtures.quantized import scaled_fp8
from fixtures.quantized import wan_pipe as with_transformer
from fixtures.tiny_models import load_bf16
from fixtures.tiny_pipes import RUNNERS, run_wan
from torch._dynamo.utils import counters

_comfy_int8_wan = comfy_files.comfy_int8_wan  # the session fixtures, under their own names
_wide_wan_dir = comfy_files.wide_wan_dir


def _streamer(engine, pipe):
    return engine.states(pipe)["transformer"].transport


def _compiled_run(pipe, config: OffloadConfig, cores_kept: bool = False,
                  buffers: int | None = None) -> tuple[torch.Tensor, dict]:
    """Two runs placed; the streamer's details, with ``block_calls``: the blocks' forwards.
    ``cores_kept``: every block's core kept, its other parts streamed (as a plan at a small cap);
    ``buffers``: the streaming buffers set by hand, the plan detached."""
    engine = Engine()
    engine.place(pipe, config)
    if cores_kept:  # a fixed budget of exactly the cores (ranked first)
        cores = sum(p.nbytes for p in _streamer(engine, pipe).pieces if p.core)
        engine.place(pipe, config.replace(preload=f"{cores}b"))
    if buffers is not None:
        _streamer(engine, pipe).events.unsubscribe("preload")
        _streamer(engine, pipe).set_lookahead(buffers)
    forwards = []
    handle = pipe.transformer.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        out = [run_wan(pipe) for _ in range(2)][-1]
        details = _streamer(engine, pipe).details()
        report = engine.report(pipe).component("transformer").line()
        streamer = _streamer(engine, pipe)
        casts = streamer.prefetch.casts
        floor = streamer.weights_at_peak() - streamer.head_bytes() - streamer.kept_bytes() - streamer._transit_peak
        return out, {**details, "block_calls": len(forwards) * details["blocks"], "report": report,
                     "casts_held": casts.held, "cast_size": casts.nbytes, "cast_in_floor": floor}
    finally:
        handle.remove()
        engine.release(pipe)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_compiled_blocks_give_the_eager_output_compiled_once(wan_pipe, placement) -> None:
    eager, _ = _compiled_run(wan_pipe, OffloadConfig(**BASE, **PLACEMENTS[placement]).replace(compile_blocks=False))
    counters.clear()
    out, details = _compiled_run(wan_pipe, OffloadConfig(**BASE, **PLACEMENTS[placement]))
    assert details["compiled_calls"] == details["block_calls"] > 0  # every block's every call
    assert f"blocks kept {details['kept']}/{details['blocks']}" in details["report"]
    assert f", {details['blocks']} compiled" in details["report"]
    assert counters["stats"]["unique_graphs"] == 1  # one graph for every block, the weights swapped under it
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["flux", "h3"])
def test_every_family_compiles_to_the_eager_output(name: str, request) -> None:
    """Flux's two towers (two block classes) and H3's blocks (LTX-2's, streamed whole, compiled to
    the same bits in a CPU check of session 37; its pipeline takes 20 s here, so it is left out)."""
    pipe, run = request.getfixturevalue(f"{name}_pipe"), RUNNERS[name]
    outs, compiled_blocks = [], []
    for on in (False, True):
        engine = Engine()
        engine.place(pipe, OffloadConfig(**BASE, preload="1000").replace(compile_blocks=on))
        try:
            out = run(pipe, seed=0)
            outs.append(out[0] if isinstance(out, tuple) else out)
            details = _streamer(engine, pipe).details()
            compiled_blocks.append((details["compiled_blocks"], details["blocks"]))
        finally:
            engine.after_run(pipe)
            engine.release(pipe)
    assert compiled_blocks[0][0] == 0 and compiled_blocks[1][0] == compiled_blocks[1][1] > 0
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


@pytest.mark.parametrize(("cores_kept", "buffers", "compiles"), [(False, 3, False), (False, None, True),
                                                                (True, None, True), (True, 3, True)])
def test_parts_streamed_run_compiled_where_the_ring_holds_them_all(wan_pipe, cores_kept, buffers, compiles) -> None:
    """A block streamed in parts is bound whole and runs compiled (no CUDA graph here: on the GPU,
    a video's call too large to graph) where its streamed parts fit the ring with a buffer to
    spare; else its parts' hooks bind them between its ops and it runs eagerly. Compiling, the
    plan holds the rest bound and the window's rest ahead (window 1: four buffers), so a block
    whose core is kept, or one streaming all three parts, is bound whole; three buffers set by
    hand still hold a rest of two, but not all three."""
    config = OffloadConfig(**BASE, preload="off")
    eager, _ = _compiled_run(wan_pipe, config.replace(compile_blocks=False), cores_kept, buffers)
    out, details = _compiled_run(wan_pipe, config, cores_kept, buffers)
    assert details["units"] == 3 * details["blocks"] and details["kept"] == 0
    assert details["kept_pieces"] == (details["blocks"] if cores_kept else 0)
    assert details["compiled_calls"] == (details["block_calls"] if compiles else 0)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


class _AddOne(ModelHook):
    def post_forward(self, module, output):
        return output + 1


def test_a_layer_with_someone_elses_hook_keeps_its_block_eager(wan_pipe, caplog) -> None:
    """The twin would skip the hook: the block runs eagerly, the hook runs, and the log says why."""
    layer = wan_pipe.transformer.blocks[0].ffn.net[2]
    HookRegistry.check_if_exists_or_initialize(layer).register_hook(_AddOne(), "user_hook")
    try:
        eager, _ = _compiled_run(wan_pipe, OffloadConfig(**BASE, preload="1000").replace(compile_blocks=False))
        with caplog.at_level(logging.INFO, logger="diffusers_offload"):
            out, details = _compiled_run(wan_pipe, OffloadConfig(**BASE, preload="1000"))
    finally:
        layer._diffusers_hook.remove_hook("user_hook", recurse=False)
    assert details["compiled_calls"] == details["block_calls"] * (details["blocks"] - 1) // details["blocks"]
    assert f", {details['blocks'] - 1} compiled" in details["report"]
    assert "runs eagerly, not compiled: hook user_hook on ffn.net.2" in caplog.text
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert not torch.equal(out, run_wan(wan_pipe))  # the hook changes the output: it ran


@pytest.mark.parametrize("scaled", [False, True], ids=["fp8", "fp8 scaled"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_fp8_blocks_dequantise_inside_the_compiled_forward(tiny_wan_dir, placement, scaled: bool) -> None:
    """A twin's fp8 layers compute ``w.to(compute) * scale`` in the graph: the bits of the
    streamer's cast path, and of a bf16 model holding those values; kept blocks cast nothing, so
    the weights the planner counts at a forward's peak hold no cast buffer (its activations
    measure the dequantised weights instead)."""
    def fp8_pipe():
        pipe = load_bf16(tiny_wan_dir)
        if scaled:
            mark_fp8(pipe.transformer, torch.bfloat16, scaled_fp8(pipe.transformer))
        else:
            store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16)
        return pipe

    config = OffloadConfig(**BASE, **PLACEMENTS[placement])
    eager, eager_details = _compiled_run(fp8_pipe(), config.replace(compile_blocks=False))
    pipe = fp8_pipe()
    out, details = _compiled_run(pipe, config)
    assert details["compiled_calls"] == details["block_calls"] > 0
    assert eager_details["cast_in_floor"] == eager_details["cast_size"] > 0
    if placement == "every block kept":
        assert details["casts_held"] == details["cast_in_floor"] == 0
    else:  # those cast as they bind
        assert details["cast_in_floor"] == details["cast_size"] > 0
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert {p.dtype for p in pipe.transformer.blocks.parameters()} >= {torch.float8_e4m3fn}  # stored bytes left as they were


@pytest.mark.parametrize("variant", [dict(), dict(per_row=True), dict(per_row=True, convrot=16)],
                         ids=["per-tensor", "per-row", "convrot"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_int8_blocks_dequantise_inside_the_compiled_forward(tiny_wan_dir, wide_wan_dir, comfy_int8_wan, placement,
                                                            variant) -> None:
    """A ComfyUI int8_tensorwise file's layers compute ``(q.float() * scale).to(compute)`` in the
    graph (convrot layers rotate their input there too): every block compiles, to the bits of the
    streamer's torch cast; kept blocks (in parts: the wide model's) cast nothing, blocks streamed
    whole are cast as they bind; the int8 bytes stay."""
    def int8_pipe():
        file = comfy_int8_wan(**variant, wide=wide_wan_dir)
        return with_transformer(tiny_wan_dir, load_denoiser(file, wide_wan_dir, torch.bfloat16))

    config = OffloadConfig(**BASE, **PLACEMENTS[placement])
    eager, eager_details = _compiled_run(int8_pipe(), config.replace(compile_blocks=False))
    pipe = int8_pipe()
    out, details = _compiled_run(pipe, config)
    assert details["compiled_calls"] == details["block_calls"] > 0
    assert eager_details["cast_in_floor"] == eager_details["cast_size"] > 0
    if placement == "every block kept":
        assert details["casts_held"] == details["cast_in_floor"] == 0
    else:
        assert details["cast_in_floor"] == details["cast_size"] > 0
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert {p.dtype for p in pipe.transformer.blocks.parameters()} >= {torch.int8}  # stored bytes left as they were


@pytest.mark.parametrize("kind", ["plain", "scaled", "static", "narrow"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_fp8_matmuls_run_inside_the_compiled_forward(tiny_wan_dir, placement, kind) -> None:
    """A twin computes its layers' fp8 matmuls (``fp8_e4m3fn_fast``; a scaled file's, with and
    without static input scales) in the graph, its inputs quantised in torch's ops: every block
    compiles and gives the eager hooks' output bit for bit (not the dequantised math's:
    `test_fp8_matmul.py`). narrow: the tiny Wan's widths are not multiples of 16, so its layers
    take the hook's fallback (the weight dequantised), in the graph too."""
    def pipe():
        if kind == "narrow":
            narrow = load_bf16(tiny_wan_dir)
            store_fp8(narrow.transformer, torch.float8_e4m3fn, torch.bfloat16, matmul=True)
            return narrow
        return wide_wan(tiny_wan_dir, scaled=kind == "scaled", static=kind == "static")

    config = OffloadConfig(**BASE, **PLACEMENTS[placement])
    eager, _ = _compiled_run(pipe(), config.replace(compile_blocks=False))
    out, details = _compiled_run(pipe(), config)
    assert details["compiled_calls"] == details["block_calls"] > 0
    assert details["cast_in_floor"] == 0  # fp8 matmuls cast nothing
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def _no_triton(graph, inputs):
    raise RuntimeError("Cannot find a working triton installation")


def test_a_compiler_that_cannot_run_turns_compiling_off_and_the_run_goes_on(wan_pipe, monkeypatch, caplog) -> None:
    """As on a Windows install without Triton: the first compiled call fails in the backend; the
    call runs its twin eagerly, every later one the usual eager path, and the log says so once."""
    eager, _ = _compiled_run(wan_pipe, OffloadConfig(**BASE, preload="1000").replace(compile_blocks=False))
    monkeypatch.setattr(compiled, "BACKEND", _no_triton)
    with caplog.at_level(logging.WARNING, logger="diffusers_offload"):
        out, details = _compiled_run(wan_pipe, OffloadConfig(**BASE, preload="1000"))
    assert details["compiled_calls"] == 0 and details["compiled_blocks"] == 0
    assert caplog.text.count("compile: off, blocks run eagerly: the compiler failed (RuntimeError: Cannot find a "
                             "working triton installation)") == 1
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_a_weight_write_and_a_release_drop_the_twins_and_a_retune_turns_it_off(wan_pipe) -> None:
    engine = Engine()
    config = OffloadConfig(**BASE, preload="1000")
    engine.place(wan_pipe, config)
    streamer = _streamer(engine, wan_pipe)
    run_wan(wan_pipe)
    twins = [weakref.ref(f.twin) for f in streamer.compiled._forwards.values()]
    assert twins and all(t() is not None for t in twins)
    streamer.before_write()
    assert streamer.compiled._forwards == {}
    run_wan(wan_pipe)
    calls = streamer.details()["compiled_calls"]
    assert streamer.driver.planner.ring_slots == 4  # the two streamed parts bound together, and the next rest
    engine.place(wan_pipe, config.replace(compile_blocks=False))  # a retune, not a re-place
    assert _streamer(engine, wan_pipe) is streamer
    assert streamer.driver.planner.ring_slots == 2  # the window's
    run_wan(wan_pipe)
    assert streamer.details()["compiled_calls"] == calls
    engine.release(wan_pipe)
    gc.collect()
    assert all(t() is None for t in twins)


def test_each_model_compiles_its_own_variants_and_a_replacement_reuses_them(tiny_wan_dir) -> None:
    """dynamo runs a code object eagerly once it holds ``recompile_limit`` compiled variants: with
    one allowed, a bf16 model's blocks compiled first must not leave an fp8 model's (another twin,
    so another variant) eager; placed again, a model runs what it compiled (no new graph)."""
    config = OffloadConfig(**BASE, preload="1000")
    with torch._dynamo.config.patch(recompile_limit=1):
        bf16 = load_bf16(tiny_wan_dir)
        fp8 = load_bf16(tiny_wan_dir)
        store_fp8(fp8.transformer, torch.float8_e4m3fn, torch.bfloat16)
        _compiled_run(bf16, config)
        assert counters["stats"]["unique_graphs"] == 1
        _, details = _compiled_run(fp8, config)
        assert details["compiled_calls"] == details["block_calls"] > 0
        assert counters["stats"]["unique_graphs"] == 2  # the fp8 twin compiled, not run eagerly past the limit
    again, _ = _compiled_run(bf16, config)  # (the default limit: a model at its limit compiles afresh)
    assert counters["stats"]["unique_graphs"] == 2
    torch.testing.assert_close(again, _compiled_run(bf16, config.replace(compile_blocks=False))[0], rtol=0, atol=0)

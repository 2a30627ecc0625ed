"""Stored layers (ComfyUI's W4A8, ConvRot W4A4, NVFP4 and MXFP8, `formats/stored_linear.py`) in compiled blocks
(``compile_blocks``) on the CPU with torch.compile's ``aot_eager`` backend (the same tracing as
inductor, no code generation): every block call runs compiled, to the eager layers' bits; the
stored tensors are left as they were. Each stored layer's kernel is one opaque op in the graph
(`stored_linear.opaque`): comfy-kitchen's CUDA calls cannot be traced."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.stored_linear import StoredLinear
from fixtures import comfy_files
from fixtures.compiling import BASE, PLACEMENTS, STORED_FORMATS, aot_eager, stored_file, two_runs  # noqa: F401  (autouse)
from fixtures.quantized import wan_pipe

_wide_wan_dir = comfy_files.wide_wan_dir  # (session fixture, under its name)
OPS = {"w4a8": "w4a8_linear", "w4a4": "w4a4_linear", "nvfp4": "nvfp4_decode", "mxfp8": "mxfp8_decode"}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("fmt", STORED_FORMATS)
def test_stored_layers_run_compiled_to_the_eager_bits(fmt, placement, tiny_wan_dir, wide_wan_dir, tmp_path) -> None:
    file, folder = stored_file(fmt, tiny_wan_dir, wide_wan_dir, tmp_path)
    config = OffloadConfig(**BASE, **PLACEMENTS[placement])
    eager, plain, _ = two_runs(wan_pipe(tiny_wan_dir, load_denoiser(file, folder, torch.bfloat16)),
                               config.replace(compile_blocks=False))
    pipe = wan_pipe(tiny_wan_dir, load_denoiser(file, folder, torch.bfloat16))
    stored = {n: t.clone() for n, t in pipe.transformer.state_dict().items()
              if t.dtype in (torch.uint8, torch.int8, torch.float8_e8m0fnu)}
    out, details, _ = two_runs(pipe, config)
    assert plain["compiled_calls"] == 0 and details["compiled_calls"] == details["block_calls"] > 0
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    after = pipe.transformer.state_dict()
    assert stored and all(torch.equal(after[n], t) for n, t in stored.items())


@pytest.mark.parametrize("fmt", STORED_FORMATS)
def test_each_stored_layer_compiles_to_one_opaque_call_of_its_kernel(fmt, tiny_wan_dir, wide_wan_dir, tmp_path) -> None:
    """A block's stored layer traced whole (``fullgraph``): its kernel is one call of the pack's
    op, nothing of comfy-kitchen inside the graph; compiled, it gives the eager layer's bits."""
    file, folder = stored_file(fmt, tiny_wan_dir, wide_wan_dir, tmp_path)
    transformer = load_denoiser(file, folder, torch.bfloat16)
    layer = next(m for m in transformer.blocks.modules() if isinstance(m, StoredLinear))
    graphs = []

    def record(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(2, 3, layer.in_features, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    out = torch.compile(layer, backend=record, fullgraph=True)(x)
    calls = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert [c for c in calls if "diffusers_offload" in c] == [f"diffusers_offload.{OPS[fmt]}.default"], calls
    assert not any("kitchen" in c for c in calls)
    torch.testing.assert_close(out, layer(x), rtol=0, atol=0)

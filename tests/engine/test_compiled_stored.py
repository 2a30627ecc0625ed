"""Stored layers (ComfyUI's W4A8, ConvRot W4A4, NVFP4 and MXFP8, `formats/stored_linear.py`) in compiled blocks
(``compile_blocks``) on the CPU with torch.compile's ``aot_eager`` backend (the same tracing as
inductor, no code generation): every block call runs compiled, comfy-kitchen's calls traced inside
the graph, to the eager layers' bits; the stored tensors are left as they were."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from fixtures import comfy_files
from fixtures.compiling import BASE, PLACEMENTS, STORED_FORMATS, aot_eager, stored_file, two_runs  # noqa: F401  (autouse)
from fixtures.quantized import wan_pipe

_wide_wan_dir = comfy_files.wide_wan_dir  # (session fixture, under its name)


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

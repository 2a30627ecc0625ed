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
from fixtures.h3_files import comfy_conditioner_state_dict
from fixtures.quantized import digest
from fixtures.tiny_pipes import run_h3
from safetensors.torch import save_file


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
    """ComfyUI's layout (``model.layers.*``, ``visual.*``, 50 layers, no head) and transformers'
    own (every layer, the head): the layers past the 50th are never read, the file never written."""
    whole = h3_pipe.text_encoder.state_dict()
    state = comfy_conditioner_state_dict(whole, 50) if layout == "comfy" else whole
    path = tmp_path / f"h3_conditioner_{layout}.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    before = digest(path)
    reference = run_h3(h3_pipe)

    encoder = load_conditioner_file(path, tiny_h3_dir / "text_encoder", torch.float32, 50)
    assert len(encoder.model.language_model.layers) == 50
    assert not any(t.is_meta for t in (*encoder.parameters(), *encoder.buffers()))
    assert isinstance(encoder.lm_head, NoHead) == (layout == "comfy")
    h3_pipe.update_components(text_encoder=encoder)
    _same(run_h3(h3_pipe), reference)
    assert digest(path) == before


def test_a_file_short_of_the_layer_read_is_refused(h3_pipe, tiny_h3_dir: Path, tmp_path: Path):
    path = tmp_path / "short.safetensors"
    save_file({k: v.contiguous() for k, v in comfy_conditioner_state_dict(h3_pipe.text_encoder.state_dict(),
                                                                            40).items()}, str(path))
    with pytest.raises(SingleFileError, match="holds 40 language-model layers; MiniMax-H3 reads the output of the "
                                              "first 50"):
        load_conditioner_file(path, tiny_h3_dir / "text_encoder", torch.float32, 50)

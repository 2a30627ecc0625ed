"""MiniMax-H3's conditioner kept to the layers its conditioning reads (`trim_conditioner`): the
tiny H3's Qwen3-VL has 53 layers, H3 reads ``hidden_states[50]``, so 51 stay and two go. The
trimmed pipeline generates bit for bit what the whole one does, and the encoder holds fewer bytes."""

from __future__ import annotations

import torch
from diffusers_offload.offload_core.components import module_bytes
from diffusers_offload.offload_core.models.minimax_h3.conditioner import trim_conditioner
from fixtures.tiny_pipes import run_h3


def test_the_layers_after_the_one_read_go_and_the_output_stays_bit_exact(h3_pipe):
    encoder = h3_pipe.text_encoder
    assert h3_pipe.text_encoder_layer == 50 and len(encoder.model.language_model.layers) == 53
    reference = run_h3(h3_pipe)
    before = module_bytes(encoder)
    layer = encoder.model.language_model.layers[51]

    assert trim_conditioner(h3_pipe) == 2
    assert len(encoder.model.language_model.layers) == 51 and encoder.config.text_config.num_hidden_layers == 51
    assert module_bytes(encoder) == before - 2 * module_bytes(layer)
    out = run_h3(h3_pipe)
    torch.testing.assert_close(out.video, reference.video, rtol=0, atol=0)
    torch.testing.assert_close(out.audio, reference.audio, rtol=0, atol=0)
    assert trim_conditioner(h3_pipe) == 0  # already at its layers


def test_other_pipelines_are_left_alone(wan_pipe):
    layers = len(wan_pipe.text_encoder.encoder.block)
    assert trim_conditioner(wan_pipe) == 0 and len(wan_pipe.text_encoder.encoder.block) == layers

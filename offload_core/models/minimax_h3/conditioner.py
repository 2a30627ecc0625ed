"""MiniMax-H3's Qwen3-VL conditioner kept to the layers its conditioning reads.

Why: H3 conditions on ``hidden_states[text_encoder_layer]`` (50 of the 32B model's 64 layers), read
off ``text_encoder.model``; the layers after the next one never change it, yet they would be held
in RAM, pinned and streamed on every encode (13 layers: ~12 GiB in bf16, a fifth of the encoder).
ComfyUI's own H3 text-encoder files stop at 50 layers. One layer past the one read stays: diffusers
refuses a stack of exactly ``text_encoder_layer`` layers, whose last hidden state is post-norm.
"""

from __future__ import annotations

import torch

from ...log import get_logger

log = get_logger("loaders")


def trim_conditioner(pipe: object) -> int:
    """Drop the conditioner's layers after ``text_encoder_layer + 1`` (the loaded object only, never
    a file); returns how many went. Pipelines without H3's ``text_encoder_layer`` are left alone."""
    layer = getattr(pipe, "text_encoder_layer", None)
    encoder = getattr(pipe, "text_encoder", None)
    stack = getattr(getattr(getattr(encoder, "model", None), "language_model", None), "layers", None)
    config = getattr(getattr(encoder, "config", None), "text_config", None)
    if not isinstance(layer, int) or not isinstance(stack, torch.nn.ModuleList) or config is None:
        return 0
    keep = layer + 1
    dropped = len(stack) - keep
    if dropped <= 0:
        return 0
    size = sum(t.numel() * t.element_size() for block in stack[keep:] for t in block.parameters())
    encoder.model.language_model.layers = stack[:keep]
    config.num_hidden_layers = keep
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:keep]
    log.info("%s: kept %d of %d layers (MiniMax-H3 reads hidden_states[%d]; %.2f GiB of later layers dropped)",
             type(encoder).__name__, keep, keep + dropped, layer, size / 2**30)
    return dropped

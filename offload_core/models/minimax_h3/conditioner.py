"""MiniMax-H3's Qwen3-VL conditioner kept to the layers its conditioning reads, loaded from its
folder or from a ComfyUI text-encoder file.

Why: H3 conditions on ``hidden_states[text_encoder_layer]`` (50 of the 32B model's 64 layers), the
output of the stack's first 50 layers before the final norm, read off ``text_encoder.model``. The
later layers never change it, yet they would be held in RAM, pinned and streamed on every encode
(14 layers: ~12.7 GiB in bf16). The stack keeps exactly those 50, as ComfyUI's own H3 text-encoder
files do; its last hidden state is then the conditioning itself, kept unnormed by transformers'
``tie_last_hidden_states`` switch, and the config names one layer more, since diffusers refuses a
stack of exactly 50 for the post-norm reason that switch removes.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ...formats.inspect import SingleFileError
from ...formats.single_file_pipeline import Fit, load_text_encoder
from ...log import get_logger

log = get_logger("loaders")
CLASS = "Qwen3VLForConditionalGeneration"
# ComfyUI's layout (comfy/sd.py reads transformers' files through the reverse renaming) -> transformers'
COMFY_PREFIXES = (("model.lm_head.", "lm_head."), ("visual.", "model.visual."), ("model.", "model.language_model."))
OURS = ("model.language_model.", "model.visual.", "lm_head.")
FINAL_NORM = "model.language_model.norm."  # ComfyUI's 32B config has none (final_norm False)
LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.")


def trim_conditioner(pipe: object) -> int:
    """`fit_conditioner` on a loaded pipeline with H3's ``text_encoder_layer`` (others are left
    alone); returns how many layers went (the loaded object only, never a file)."""
    layer = getattr(pipe, "text_encoder_layer", None)
    encoder = getattr(pipe, "text_encoder", None)
    if not isinstance(layer, int) or type(encoder).__name__ != CLASS:
        return 0
    return fit_conditioner(encoder, layer)


def fit_conditioner(encoder: torch.nn.Module, layer: int) -> int:
    """Keep the first ``layer`` decoder layers, the last hidden state unnormed, the config one layer
    longer (see the module docstring); returns how many layers went."""
    stack = encoder.model.language_model.layers
    if len(stack) < layer:
        raise SingleFileError(f"the text encoder has {len(stack)} layers; MiniMax-H3 reads the output of its "
                              f"first {layer}: pick MiniMax-H3's text encoder")
    dropped = len(stack) - layer
    size = sum(t.numel() * t.element_size() for block in stack[layer:] for t in block.parameters())
    encoder.model.language_model.layers = stack[:layer]
    _set_depth(encoder.config.text_config, layer + 1)
    encoder.config.text_config.tie_last_hidden_states = False
    if dropped:
        log.info("%s: kept %d of %d layers (MiniMax-H3 reads hidden_states[%d]; %.2f GiB of later layers dropped)",
                 CLASS, layer, layer + dropped, layer, size / 2**30)
    return dropped


def load_conditioner_file(path: Path, config: Path, dtype: torch.dtype, layer: int) -> torch.nn.Module:
    """H3's conditioner from a single file in ComfyUI's layout (``model.layers.*``, ``visual.*``;
    ComfyUI's H3 files stop at 50 layers and have no language-model head) or transformers', into the
    config of ``config`` (the folder's ``text_encoder``); layers past ``layer`` are dropped as read.
    A file without the final norm (ComfyUI's model of it has none) gets an identity there: the
    norm only ever applies to the last hidden state, which H3 reads unnormed."""
    fit = Fit(keys=lambda state: _transformers_keys(path, state, layer),
              config=lambda cfg: _with_layers(cfg, layer), absent=("lm_head.", FINAL_NORM))
    encoder = load_text_encoder(path, config, CLASS, dtype, fit)
    if any(p.is_meta for p in encoder.lm_head.parameters()):
        encoder.lm_head = NoHead()
    if any(p.is_meta for p in encoder.model.language_model.norm.parameters()):
        encoder.model.language_model.norm = torch.nn.Identity()  # it only norms the unread last state
    fit_conditioner(encoder, layer)
    return encoder


class NoHead(torch.nn.Module):
    """Where the language-model head was: the file had none, and MiniMax-H3 never calls it."""

    def forward(self, *_args: object, **_kwargs: object) -> torch.Tensor:
        raise RuntimeError("this MiniMax-H3 conditioner was loaded from a file without a language-model head: "
                           "it gives hidden states (text_encoder.model), not logits")


def _transformers_keys(path: Path, state: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if not key.startswith(OURS):
            key = next((new + key[len(old):] for old, new in COMFY_PREFIXES if key.startswith(old)), key)
        out[key] = value
    depth = 1 + max((int(m.group(1)) for k in out if (m := LAYER.match(k))), default=-1)
    if depth < layer:
        raise SingleFileError(f"{path} holds {depth} language-model layers; MiniMax-H3 reads the output of the "
                              f"first {layer}: pick MiniMax-H3's text encoder")
    return {k: v for k, v in out.items() if not ((m := LAYER.match(k)) and int(m.group(1)) >= layer)}


def _with_layers(config: object, layer: int) -> object:
    _set_depth(config.text_config, layer)
    return config


def _set_depth(text_config: object, layers: int) -> None:
    text_config.num_hidden_layers = layers
    if getattr(text_config, "layer_types", None):
        text_config.layer_types = text_config.layer_types[:layers]

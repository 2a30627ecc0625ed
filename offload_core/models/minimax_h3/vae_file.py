"""MiniMax-H3's video VAE from a single file, in ComfyUI's layout (``comfy/ldm/minimax/vae.py``:
``encoder.down.*.block.*``, a fused ``to_qkv`` per decoder block, ``ff.w1``/``ff.w2``) or diffusers'.

Why our own: diffusers 0.42.1 has no single-file converter for ``AutoencoderKLMiniMaxH3``. The
renames mirror ComfyUI's module tree; its ``to_qkv`` rows are per head ``[q | k | v]`` (it views
the output as ``heads x 3·head_dim`` and chunks), and its gated FFN puts the gate first where
diffusers' SwiGLU puts it second. ``latents_mean``/``latents_std`` are buffers in ComfyUI's file and
config values in diffusers'; the file's values are the ones used. ComfyUI's int8 decoder files
(``int8_tensorwise``, convrot or not) are decoded at load, as comfy-kitchen decodes them: the VAE
runs once a prompt, in its working dtype.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from accelerate import init_empty_weights
from diffusers import AutoencoderKLMiniMaxH3
from safetensors.torch import load_file

from ...formats.decoded import decoded_weight
from ...formats.inspect import SingleFileError, SingleFileInfo, inspect_safetensors
from ...formats.quant_entries import INT8_QUANT, check_quant_layers, convrot_groups, read_quant_layers
from ...formats.state_fit import mismatch_text
from ...log import get_logger

log = get_logger("loaders")
COMFY_SIGN = "decoder.transformer_blocks.0.attn.to_qkv.weight"
LATENT_STATS = ("latents_mean", "latents_std")
UNUSED = ("decoder.mask_token",)  # ComfyUI's decoder holds it; neither decode path reads it
RENAMES = (
    (re.compile(r"^encoder\.down\.(\d+)\.block\.(\d+)\."), r"encoder.down_blocks.\1.resnets.\2."),
    (re.compile(r"^encoder\.down\.(\d+)\.downsample\."), r"encoder.down_blocks.\1.downsamplers.0."),
    (re.compile(r"\.nin_shortcut\."), ".conv_shortcut."),
    (re.compile(r"^decoder\.x_embedder\."), "decoder.proj_in."),
    (re.compile(r"\.attn\.to_out\.(weight|bias)$"), r".attn.to_out.0.\1"),
    (re.compile(r"\.ff\.w1\."), ".ff.net.0.proj."),
    (re.compile(r"\.ff\.w2\."), ".ff.net.2."),
)


def load_vae_file(path: Path, config: Path, dtype: torch.dtype) -> AutoencoderKLMiniMaxH3:
    """The VAE of ``config`` (the folder's ``vae``) with the weights of ``path``, either layout;
    a file that does not fill the model exactly is refused, naming the keys."""
    info = inspect_safetensors(path)
    state = load_file(str(path))
    if info.quantized:
        state = _decoded(path, info, state)
    layout = "ComfyUI's" if COMFY_SIGN in state else "diffusers'"
    cfg = dict(AutoencoderKLMiniMaxH3.load_config(str(config)))
    if COMFY_SIGN in state:
        state = diffusers_state(state, cfg["decoder_num_attention_heads"])
    for name in LATENT_STATS:
        if name in state:
            cfg[name] = [float(v) for v in state.pop(name).float()]
    with init_empty_weights():  # buffers (rotary tables) are made for real
        vae = AutoencoderKLMiniMaxH3.from_config(cfg)
    check_fills(path, vae.state_dict(), state, "video VAE", "vae_file")
    vae.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, assign=True)
    log.info("%s: MiniMax-H3 VAE in %s layout", path.name, layout)
    return vae.eval()


def _decoded(path: Path, info: SingleFileInfo, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An int8_tensorwise file's layers as float32 weights (comfy-kitchen's dequantisation, a convrot
    one rotated back); any other quantized VAE is refused by name."""
    layers = read_quant_layers(info)
    formats = {str(conf.get("format")) if isinstance(conf, dict) else repr(conf) for conf in layers.values()}
    if not layers or formats != {INT8_QUANT} or set(info.scales) != set(layers):
        raise SingleFileError(f"{path} is a quantized VAE ({info.format}, formats {sorted(formats) or 'none'}); the "
                              "engine decodes ComfyUI's int8_tensorwise VAE files only: pick that or the unquantized one")
    check_quant_layers(info)
    groups = convrot_groups(info)
    state = {k: v for k, v in state.items() if not k.endswith(".comfy_quant")}
    for layer, key in info.scales.items():
        state[f"{layer}.weight"] = decoded_weight(path, layer, state[f"{layer}.weight"], state.pop(key), torch.float32,
                                                  groups.get(layer, 0))
    log.info("%s: %d int8 layers (%d convrot) decoded to float32", path.name, len(layers), len(groups))
    return state


def check_fills(path: Path, expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor], what: str,
                field: str) -> None:
    """``state`` fills a model of ``expected`` keys and shapes exactly, else the file is refused by name."""
    problem = mismatch_text(expected, state)
    if problem:
        raise SingleFileError(f"{path} is not a MiniMax-H3 {what} of the folder's configuration: {problem}; pick "
                              f"H3's {what} file or leave {field} at 'none'")


def diffusers_state(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """ComfyUI's H3 VAE keys and fused tensors as diffusers names and splits them."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in UNUSED:
            continue
        if ".attn.to_qkv." in key:
            q, k, v = value.unflatten(0, (heads, 3, -1)).unbind(1)
            for name, part in (("to_q", q), ("to_k", k), ("to_v", v)):
                out[key.replace("to_qkv", name)] = part.flatten(0, 1).contiguous()
            continue
        if ".ff.w1." in key:
            gate, hidden = value.chunk(2, dim=0)
            value = torch.cat([hidden, gate])
        for pattern, new in RENAMES:
            key = pattern.sub(new, key)
        out[key] = value
    return out

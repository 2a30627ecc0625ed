"""MiniMax-H3's audio VAE from a single file, in ComfyUI's layout (``comfy/ldm/minimax/audio_vae.py``:
each weight-normalised convolution stored folded, as one ``weight``; ``latents_mean``/``latents_std``
as tensors) or diffusers' (``weight_g``/``weight_v``).

Why our own: diffusers 0.42.1 has no single-file loader for ``AutoencoderKLMiniMaxH3Audio``. Where
the file holds a folded weight, that convolution's weight norm is removed and it holds the file's
weight as it is: the weights ComfyUI computes with, bit for bit (re-splitting them into a norm and a
direction would round them), and no norm recomputed at each forward. The latent statistics go into
the config, where diffusers reads them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import init_empty_weights
from diffusers import AutoencoderKLMiniMaxH3Audio
from safetensors.torch import load_file

from ...formats.inspect import SingleFileError, inspect_safetensors
from ...formats.state_fit import keeps_fp32
from ...log import get_logger
from .vae_file import check_fills

log = get_logger("loaders")
LATENT_STATS = ("latents_mean", "latents_std")
NORMED = ".weight_g"  # weight norm's magnitude: its module's direction is ``.weight_v``


def load_audio_vae_file(path: Path, config: Path, dtype: torch.dtype) -> AutoencoderKLMiniMaxH3Audio:
    """The audio VAE of ``config`` (the folder's ``audio_vae``) with the weights of ``path``, either
    layout; its modules diffusers keeps in float32 stay so whatever ``dtype``; a file that does not
    fill the model exactly is refused, naming the keys."""
    path = Path(path)
    info = inspect_safetensors(path)
    if info.quantized:
        raise SingleFileError(f"{path} is a quantized audio VAE ({info.format}): pick H3's fp32 audio VAE file "
                              "(minimax_h3_audio_vae_fp32)")
    state = load_file(str(path))
    cfg = dict(AutoencoderKLMiniMaxH3Audio.load_config(str(config)))
    for name in LATENT_STATS:
        if name in state:
            cfg[name] = [float(v) for v in state.pop(name).float()]
    if cfg.get("latents_mean") is None or cfg.get("latents_std") is None:
        raise SingleFileError(f"{path} holds no latents_mean / latents_std and {config} names none: pick ComfyUI's "
                              "H3 audio VAE file (minimax_h3_audio_vae_fp32), which carries them")
    with init_empty_weights():  # buffers (the resampling filters) are made for real
        vae = AutoencoderKLMiniMaxH3Audio.from_config(cfg)
    folded = _unnorm_folded(vae, state)
    check_fills(path, vae.state_dict(), state, "audio VAE", "audio_vae_file")
    vae.load_state_dict({k: v.to(torch.float32 if keeps_fp32(type(vae), k) else dtype) if v.is_floating_point()
                         else v for k, v in state.items()}, assign=True)
    log.info("%s: MiniMax-H3 audio VAE in %s layout", path.name,
             f"ComfyUI's ({folded} folded weight-norm convolutions)" if folded else "diffusers'")
    return vae.eval()


def _unnorm_folded(vae: torch.nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Removes the weight norm of each module whose weight ``state`` holds folded; how many."""
    modules = dict(vae.named_modules())
    folded = [k.removesuffix(NORMED) for k in vae.state_dict() if k.endswith(NORMED)
              and f"{k.removesuffix(NORMED)}.weight" in state and k not in state]
    for name in folded:
        torch.nn.utils.remove_weight_norm(modules[name])
    return len(folded)

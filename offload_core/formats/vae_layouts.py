"""VAEs in their original key layouts that diffusers' single-file loader does not take. Wan 2.2's
(Comfy-Org's ``wan2.2_vae.safetensors``, ComfyUI's ``comfy.ldm.wan.vae2_2`` state dict): diffusers'
single-file converter knows only Wan 2.1's flat block layout and misplaces 2.2's nested blocks (a
shape error), so the keys are renamed here as diffusers' own ``scripts/convert_wan_to_diffusers.py``
(``convert_vae_22``) renames them. Qwen-Image's (``qwen_image_vae.safetensors``: Wan 2.1's layout,
which ComfyUI loads as a Wan VAE): diffusers' ``AutoencoderKLQwenImage`` has no single-file loader,
but its names are ``AutoencoderKLWan``'s, so diffusers' own Wan 2.1 converter renames the keys.
FLUX.2's (``flux2-vae.safetensors``: the LDM layout, its quant convolutions inside the encoder and
decoder, and the latents' batch-norm statistics): ``AutoencoderKLFlux2`` has no single-file loader
either; diffusers' LDM converter renames the keys, as its ``scripts/convert_flux2_to_diffusers.py``
does, once the two convolutions are where that converter looks (as ComfyUI moves them).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..log import get_logger
from .inspect import SingleFileError

log = get_logger("single_file")

MARKER = "decoder.upsamples.0.upsamples.0.residual.2.weight"  # (ComfyUI tells a Wan 2.2 VAE by it)
FLUX2_MARKER = "bn.running_mean"  # (ComfyUI tells a FLUX.2 VAE by it)
FLUX2_MOVED = (("encoder.quant_conv.", "quant_conv."), ("decoder.post_quant_conv.", "post_quant_conv."))
FLUX2_STATS = ("bn.running_mean", "bn.running_var")
NESTED = re.compile(r"^(encoder|decoder)\.(?:down|up)samples\.(\d+)\.(?:down|up)samples\.(\d+)\.(.*)$")
MIDDLE = re.compile(r"^(encoder|decoder)\.middle\.(\d)\.(.*)$")
RESIDUAL = (("residual.0.", "norm1."), ("residual.2.", "conv1."), ("residual.3.", "norm2."), ("residual.6.", "conv2."),
            ("shortcut.", "conv_shortcut."))
OTHER = (("encoder.conv1.", "encoder.conv_in."), ("decoder.conv1.", "decoder.conv_in."),
         ("encoder.head.0.", "encoder.norm_out."), ("encoder.head.2.", "encoder.conv_out."),
         ("decoder.head.0.", "decoder.norm_out."), ("decoder.head.2.", "decoder.conv_out."),
         ("conv1.", "quant_conv."), ("conv2.", "post_quant_conv."))


def is_wan22_vae(keys: Any) -> bool:
    return MARKER in keys


def diffusers_key(key: str) -> str:
    """One original Wan 2.2 VAE key under diffusers' ``AutoencoderKLWan`` name."""
    if m := NESTED.match(key):
        side, block, index, rest = m.groups()
        blocks = "down_blocks" if side == "encoder" else "up_blocks"
        if rest.startswith(("resample.", "time_conv.")):
            return f"{side}.{blocks}.{block}.{'downsampler' if side == 'encoder' else 'upsampler'}.{rest}"
        return f"{side}.{blocks}.{block}.resnets.{index}.{_residual(rest)}"
    if m := MIDDLE.match(key):
        side, index, rest = m.groups()
        if index == "1":
            return f"{side}.mid_block.attentions.0.{rest}"
        return f"{side}.mid_block.resnets.{int(index) // 2}.{_residual(rest)}"
    return next((new + key[len(old):] for old, new in OTHER if key.startswith(old)), key)


def _residual(rest: str) -> str:
    return next((new + rest[len(old):] for old, new in RESIDUAL if rest.startswith(old)), rest)


def load_wan22_vae(path: Path, cls: type, config: Path, dtype: torch.dtype) -> Any:
    """``cls`` (AutoencoderKLWan) of the VAE config in ``config`` holding the file's weights, in ``dtype``."""
    from safetensors.torch import load_file

    settings = cls.load_config(str(config))
    if settings.get("z_dim") != 48:
        raise SingleFileError(f"{path} is a Wan 2.2 VAE (48 latent channels), but the VAE of {config.parent} has "
                              f"{settings.get('z_dim')}: pick the VAE file this model uses (Wan 2.1's for it)")
    state = {diffusers_key(k): v for k, v in load_file(str(path)).items()}
    return _assigned(path, cls, config, state, dtype, "Wan 2.2 VAE")


def load_qwen_image_vae(path: Path, cls: type, config: Path, dtype: torch.dtype) -> Any:
    """``cls`` (AutoencoderKLQwenImage) of the VAE config in ``config`` holding the file's weights (Wan
    2.1's original names, or diffusers' own, which the converter keeps), in ``dtype``."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    if is_wan22_vae(tensors):
        raise SingleFileError(f"{path} is a Wan 2.2 VAE (48 latent channels), not Qwen-Image's: pick "
                              "qwen_image_vae.safetensors")
    state = convert_wan_vae_to_diffusers(tensors)
    return _assigned(path, cls, config, state, dtype, "Qwen-Image VAE")


def is_flux2_vae(keys: Any) -> bool:
    return FLUX2_MARKER in keys


def load_flux2_vae(path: Path, cls: type, config: Path, dtype: torch.dtype) -> Any:
    """``cls`` (AutoencoderKLFlux2) of the VAE config in ``config`` holding the file's weights (the
    LDM layout of ``flux2-vae.safetensors``) and its latent statistics, in ``dtype``."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    if not is_flux2_vae(tensors):
        raise SingleFileError(f"{path} has no latent statistics ({FLUX2_MARKER}): it is not a FLUX.2 VAE; pick "
                              "flux2-vae.safetensors")
    moved = {next((new + k[len(old):] for old, new in FLUX2_MOVED if k.startswith(old)), k): t
             for k, t in tensors.items()}
    state = convert_ldm_vae_checkpoint(moved, cls.load_config(str(config)))
    state |= {k: moved[k] for k in FLUX2_STATS}
    return _assigned(path, cls, config, state, dtype, "FLUX.2 VAE")


def own_loader(cls: type, keys: Any) -> Any:
    """The pack's loader for a VAE of class ``cls`` whose file holds ``keys``, or None where
    diffusers' single-file loader reads it (Qwen-Image's and FLUX.2's classes have none; a Wan 2.2
    file it misreads)."""
    by_class = {"AutoencoderKLQwenImage": load_qwen_image_vae, "AutoencoderKLFlux2": load_flux2_vae}
    return by_class.get(cls.__name__) or (load_wan22_vae if is_wan22_vae(keys) else None)


def _assigned(path: Path, cls: type, config: Path, state: dict[str, torch.Tensor], dtype: torch.dtype,
              what: str) -> Any:
    """``cls`` built empty from the config in ``config`` holding ``state`` (every key, strictly), in ``dtype``."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = cls.from_config(cls.load_config(str(config)))
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise SingleFileError(f"{path} does not match the {what} config of {config.parent}: {exc}") from exc
    log.info("%s: %s converted from its original layout", path.name, what)
    return model.to(dtype).eval()

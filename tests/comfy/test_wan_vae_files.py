"""Wan VAE files as Comfy-Org ships them (wan_2.1_vae / wan2.2_vae.safetensors: the original Wan
key layout, which is ComfyUI's own ``comfy.ldm.wan`` modules' state dict) through the pack's VAE
loader: each decodes a latent as ComfyUI's own VAE holding the same weights does. The VAEs are
ComfyUI's classes at a small width, random weights, saved with safetensors as those files are.
Wan 2.2's goes through the pack's own key conversion (`formats.vae_layouts`): diffusers' single-file
converter misplaces its nested blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from comfyhost import harness
from diffusers import AutoencoderKLWan
from safetensors.torch import save_file

pytest_plugins = ["comfyhost.fixtures"]
WAN21 = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])


def _random(model: torch.nn.Module) -> torch.nn.Module:
    """ComfyUI's layers skip weight init (``comfy.ops``): random weights, norm scales near 1."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if name.endswith("gamma") else 0.1 * torch.randn_like(param))
    return model.eval()


def _saved(model: torch.nn.Module, path: Path) -> Path:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def _config_folder(tmp: Path, **config) -> Path:
    with torch.device("meta"):
        AutoencoderKLWan(**config).save_config(tmp / "configs" / "vae")
    return tmp / "configs"


def _ours(comfy: harness.ComfyHost, file: Path, folder: Path) -> AutoencoderKLWan:
    """The VAE file as the pack's single-file loader reads it (its VAE file input)."""
    return comfy.pack_submodule("offload_core.formats.single_file_pipeline").load_vae(file, folder, torch.float32).eval()


def test_a_wan_2_1_vae_file_decodes_as_comfyuis_wan_vae(comfy: harness.ComfyHost, tmp_path: Path) -> None:
    from comfy.ldm.wan.vae import WanVAE

    torch.manual_seed(0)
    theirs = _random(WanVAE(dim=WAN21["base_dim"], z_dim=16, dim_mult=WAN21["dim_mult"], num_res_blocks=2,
                            attn_scales=[], temperal_downsample=WAN21["temperal_downsample"]))
    ours = _ours(comfy, _saved(theirs, tmp_path / "wan_2.1_vae_tiny.safetensors"), _config_folder(tmp_path, **WAN21))
    _decode_alike(ours, theirs, torch.randn(1, 16, 3, 4, 4))


def _decode_alike(ours: AutoencoderKLWan, theirs: torch.nn.Module, latent: torch.Tensor) -> None:
    """Both decode ``latent`` to the same frames (ComfyUI's clamped as diffusers' are), not saturated."""
    with torch.no_grad():
        out, ref = ours.decode(latent).sample, theirs.decode(latent).clamp(-1, 1)
    assert out.shape == ref.shape and ref.abs().lt(0.99).float().mean() > 0.5 and ref.std() > 0.05
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def test_a_wan_2_2_vae_file_decodes_as_comfyuis_wan_2_2_vae(comfy: harness.ComfyHost, tmp_path: Path) -> None:
    """Wan 2.2 TI2V-5B's VAE (48 latent channels, x16 in space, residual blocks, a wider decoder)."""
    from comfy.ldm.wan.vae2_2 import WanVAE

    torch.manual_seed(0)
    theirs = _random(WanVAE(dim=8, dec_dim=12, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                            temperal_downsample=[False, True, True]))
    config = dict(base_dim=8, decoder_base_dim=12, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
                  patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4, dim_mult=[1, 2, 4, 4],
                  num_res_blocks=2, temperal_downsample=[False, True, True], latents_mean=[0.0] * 48,
                  latents_std=[1.0] * 48)
    file = _saved(theirs, tmp_path / "wan2.2_vae_tiny.safetensors")
    _decode_alike(_ours(comfy, file, _config_folder(tmp_path, **config)), theirs, torch.randn(1, 48, 3, 2, 2))
    with pytest.raises(ValueError, match="wan2.2_vae_tiny.safetensors is a Wan 2.2 VAE .* pick the VAE file this model"):
        _ours(comfy, file, _config_folder(tmp_path / "wan21", **WAN21))

"""MiniMax-H3's VAE file conversions (`models/minimax_h3/vae_file.py`, `audio_vae_file.py`) against
ComfyUI's own ``MiniMaxH3VideoVAE`` and ``MiniMaxH3AudioVAE``: a small random ComfyUI VAE saved in its
own layout, loaded by the pack into diffusers' class, encoder and decoder outputs compared; the audio
one also against the suite's fixture for that layout (`fixtures.h3_files.comfy_h3_audio_vae_state_dict`:
the same keys and shapes). CPU; needs a 2026 ComfyUI tree (H3 support) with comfy-aimdo importable.
CI's ComfyUI (v0.3.75) has no H3 VAEs, hence a script, not a test.

    PYTHONPATH=<comfy-aimdo> python bench/h3_vae_comfy_check.py --comfy-dir .gpu/comfyui
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from benchkit import comfy_on_cpu, pack


def main() -> None:
    comfy_on_cpu()
    import comfy.ldm.minimax.vae as cv
    import comfy.ops
    from diffusers import AutoencoderKLMiniMaxH3
    from safetensors.torch import save_file

    pack()
    from diffusers_offload.offload_core.models.minimax_h3.vae_file import load_vae_file

    defaults = list(cv.ViT3DDecoder.__init__.__defaults__)  # ComfyUI fixes the decoder's size: shrink it
    defaults[4], defaults[5], defaults[6], defaults[11] = 2, 2, 64, 1  # layers, heads, head dim, registers
    cv.ViT3DDecoder.__init__.__defaults__ = tuple(defaults)
    torch.manual_seed(0)
    comfy_vae = cv.MiniMaxH3VideoVAE(ch=32, ch_mult=(1,) * 6, num_res_blocks=1, z_channels=4, embed_dim=4,
                                     operations=comfy.ops.manual_cast).float()
    saved = set(comfy_vae.state_dict())
    for name, t in [*comfy_vae.named_parameters(), *comfy_vae.named_buffers()]:
        if name in saved:  # not the rotary tables
            t.data.normal_(0, 0.2)
    tmp = Path(tempfile.mkdtemp())
    save_file({k: v.contiguous() for k, v in comfy_vae.state_dict().items()}, str(tmp / "h3_vae.safetensors"))
    AutoencoderKLMiniMaxH3(latent_channels=4, block_out_channels=(32,) * 6, layers_per_block=1, norm_num_groups=32,
                           decoder_num_layers=2, decoder_num_attention_heads=2, decoder_attention_head_dim=64,
                           decoder_num_register_tokens=1, decoder_ffn_mult=4).save_config(str(tmp / "vae"))
    ours = load_vae_file(tmp / "h3_vae.safetensors", tmp / "vae", torch.float32)
    z, x = torch.randn(1, 4, 2, 2, 3), torch.randn(1, 3, 1, 32, 32)
    with torch.no_grad():
        dec = (comfy_vae.decoder(comfy_vae.post_quant_conv(z)) - ours.decoder(ours.post_quant_conv(z))).abs().max()
        enc = (comfy_vae.encoder(x) - ours.encoder(x)).abs().max()
    stats = torch.equal(torch.tensor(ours.config.latents_mean), comfy_vae.latents_mean.flatten())
    print(f"decoder max |diff| {dec.item():.3g}, encoder max |diff| {enc.item():.3g}, latent statistics equal: {stats}")
    if dec > 1e-4 or enc > 1e-4 or not stats:
        raise SystemExit("the conversion differs from ComfyUI's H3 VAE")
    audio(tmp)


def audio(tmp: Path) -> None:
    """ComfyUI's H3 audio VAE at a small width (its decoder's rates are fixed: 800 samples a frame)."""
    import comfy.ldm.minimax.audio_vae as ca
    from diffusers import AutoencoderKLMiniMaxH3Audio
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from diffusers_offload.offload_core.models.minimax_h3.audio_vae_file import load_audio_vae_file
    from fixtures.h3_files import comfy_h3_audio_vae_state_dict

    torch.manual_seed(0)
    comfy_vae = ca.MiniMaxH3AudioVAE(encoder_dim=4, latent_dim=16, decoder_dim=128, vae_latent_channels=8).float()
    for _, t in [*comfy_vae.named_parameters(), *comfy_vae.named_buffers()]:
        t.data.normal_(0, 0.14)
    comfy_vae.latents_std.data.abs_().add_(0.5)
    save_file({k: v.contiguous() for k, v in comfy_vae.state_dict().items()}, str(tmp / "h3_audio_vae.safetensors"))
    config = dict(encoder_dim=4, latent_dim=16, latent_channels=8, decoder_dim=128)
    AutoencoderKLMiniMaxH3Audio(**config).save_config(str(tmp / "audio_vae"))
    ours = load_audio_vae_file(tmp / "h3_audio_vae.safetensors", tmp / "audio_vae", torch.float32)
    fixture = comfy_h3_audio_vae_state_dict(AutoencoderKLMiniMaxH3Audio(**config, latents_mean=[0.0] * 8,
                                                                        latents_std=[1.0] * 8))
    theirs = comfy_vae.state_dict()
    layout = {k: tuple(v.shape) for k, v in fixture.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    wave, z = torch.rand(1, 2, 1600) * 2 - 1, torch.randn(1, 8, 2, 3)
    with torch.no_grad():
        enc = (comfy_vae.encode(wave) - _normed_mean(ours, wave)).abs().max()
        mono = z.permute(0, 2, 1, 3).flatten(0, 1)
        denorm = mono * torch.tensor(ours.config.latents_std)[:, None] + torch.tensor(ours.config.latents_mean)[:, None]
        ref = comfy_vae.decode(z)
        dec = (ref - ours.decode(denorm).sample.reshape(1, 2, -1)).abs().max()
    clipped = (ref.abs() == 1).float().mean().item()  # ComfyUI's decode clamps to [-1, 1]
    spread = ref.std().item()
    print(f"audio: decoder max |diff| {dec.item():.3g} ({clipped:.0%} of samples at the clamp, std {spread:.3g}), encoder max |diff| "
          f"{enc.item():.3g}, the fixture's layout is ComfyUI's: {layout}")
    if dec > 1e-4 or enc > 1e-4 or not layout or clipped > 0.5:
        raise SystemExit("the conversion differs from ComfyUI's H3 audio VAE")


def _normed_mean(vae: torch.nn.Module, wave: torch.Tensor) -> torch.Tensor:
    """diffusers' posterior mean of each stereo channel, normalised as ComfyUI's ``encode`` returns it."""
    mean = vae.encode(wave.reshape(2, 1, -1)).latent_dist.mode()
    mean = (mean - torch.tensor(vae.config.latents_mean)[:, None]) / torch.tensor(vae.config.latents_std)[:, None]
    return mean.unsqueeze(0).permute(0, 2, 1, 3)


if __name__ == "__main__":
    main()

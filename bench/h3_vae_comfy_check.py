"""MiniMax-H3's VAE file conversion (`models/minimax_h3/vae_file.py`) against ComfyUI's own
``MiniMaxH3VideoVAE``: a small random ComfyUI VAE saved in its own layout, loaded by the pack into
diffusers' class, encoder and decoder outputs compared. CPU; needs a 2026 ComfyUI tree (H3 support)
with comfy-aimdo importable. CI's ComfyUI (v0.3.75) has no H3 VAE, hence a script, not a test.

    PYTHONPATH=<comfy-aimdo> python bench/h3_vae_comfy_check.py --comfy-dir .gpu/comfyui
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from benchkit import pack


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfy-dir", required=True)
    args = ap.parse_args()
    sys.argv = [sys.argv[0], "--cpu"]
    sys.path.insert(0, args.comfy_dir)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
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


if __name__ == "__main__":
    main()

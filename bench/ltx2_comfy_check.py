"""The suite's tiny LTX-2 checkpoint (`tests/fixtures/ltx2_files.py`: LTX-2's original layout, the
all-in-one file ComfyUI users hold) against ComfyUI's own LTX-2 modules built at the same tiny sizes:
``LTXAVModel`` (the transformer and both text connectors), ``VideoVAE`` (version-2 blocks),
``AudioVAE`` (its autoencoder and ``Vocoder``). The key sets must be equal, shapes too except where
ComfyUI hard-codes a size (128: learnable registers, latent statistics, the vocoder's input). CPU;
needs a 2026 ComfyUI tree (LTX-2 support) with comfy-aimdo importable, hence a script, not a test.

    PYTHONPATH=<comfy-aimdo> python bench/ltx2_comfy_check.py --comfy-dir .gpu/comfyui
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from benchkit import comfy_on_cpu

TESTS = Path(__file__).resolve().parents[1] / "tests"
EXTRA_STATS = ("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds",  # Lightricks' own file
               "per_channel_statistics.mean-of-stds_over_std-of-means")  # has them, ComfyUI's module does not
HARD_CODED = ("learnable_registers", "per_channel_statistics.", "vocoder.conv_pre.weight")


def main() -> None:
    comfy_on_cpu(TESTS)
    from diffusers import LTX2Pipeline
    from fixtures.ltx2_files import build_tiny_ltx2_checkpointable, ltx2_checkpoint_state

    folder = build_tiny_ltx2_checkpointable(Path(tempfile.mkdtemp()) / "tiny-ltx2")
    pipe = LTX2Pipeline.from_pretrained(str(folder), dtype=torch.float32)
    ours = {k: tuple(v.shape) for k, v in ltx2_checkpoint_state(pipe).items()}
    failures = [compare(name, part(ours, prefix, new), theirs) for name, prefix, new, theirs in comfy_parts(pipe)]
    if any(failures):
        raise SystemExit("the tiny checkpoint's layout differs from ComfyUI's LTX-2 modules")


def part(ours: dict, prefix: str, new: str = "") -> dict:
    return {new + k[len(prefix):]: s for k, s in ours.items() if k.startswith(prefix) and not k.endswith(EXTRA_STATS)}


def compare(name: str, ours: dict, theirs: dict) -> bool:
    """Prints the comparison; True when it fails."""
    only_ours, only_theirs = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    shapes = {k: (ours[k], theirs[k]) for k in ours.keys() & theirs.keys() if ours[k] != theirs[k]}
    unexplained = {k: v for k, v in shapes.items() if not any(h in k for h in HARD_CODED)}
    print(f"{name}: {len(ours)} keys, ComfyUI's {len(theirs)}; only ours {only_ours[:3]}, only ComfyUI's "
          f"{only_theirs[:3]}; shapes ComfyUI hard-codes {len(shapes) - len(unexplained)}, others {unexplained}")
    return bool(only_ours or only_theirs or unexplained)


def comfy_parts(pipe) -> list[tuple[str, str, str, dict]]:
    """(what, our key prefix, its name in ComfyUI's module, ComfyUI's module's key shapes)."""
    import comfy.ops
    from comfy.ldm.lightricks.av_model import LTXAVModel
    from comfy.ldm.lightricks.vae.audio_vae import AudioVAE
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    def shapes(module: torch.nn.Module) -> dict:
        return {k: tuple(v.shape) for k, v in module.state_dict().items()}

    t, c = pipe.transformer.config, pipe.connectors.config
    with torch.device("meta"):
        dit = LTXAVModel(in_channels=t.in_channels, audio_in_channels=t.audio_in_channels,
                         cross_attention_dim=t.num_attention_heads * t.attention_head_dim,
                         audio_cross_attention_dim=t.audio_num_attention_heads * t.audio_attention_head_dim,
                         attention_head_dim=t.attention_head_dim, audio_attention_head_dim=t.audio_attention_head_dim,
                         num_attention_heads=t.num_attention_heads, audio_num_attention_heads=t.audio_num_attention_heads,
                         caption_channels=t.caption_channels, num_layers=t.num_layers,
                         connector_num_attention_heads=c.video_connector_num_attention_heads,
                         connector_attention_head_dim=c.video_connector_attention_head_dim,
                         connector_num_layers=c.video_connector_num_layers, operations=comfy.ops.disable_weight_init)
    audio = AudioVAE(metadata={"config": {"audio_vae": _audio_config(pipe), "vocoder": _vocoder_config(pipe)}})
    audio_shapes = shapes(audio)
    return [
        ("transformer and connectors vs LTXAVModel", "model.diffusion_model.", "", shapes(dit)),
        ("video VAE vs VideoVAE", "vae.", "", shapes(VideoVAE(config=_video_config(pipe)))),
        ("audio VAE vs AudioVAE.autoencoder", "audio_vae.", "autoencoder.",
         {k: s for k, s in audio_shapes.items() if k.startswith("autoencoder.")}),
        ("vocoder vs AudioVAE.vocoder", "vocoder.", "vocoder.",
         {k: s for k, s in audio_shapes.items() if k.startswith("vocoder.")}),
    ]


def _video_config(pipe) -> dict:
    """ComfyUI's version-2 block list for the tiny VAE's widths and depths."""
    v = pipe.vae.config
    kinds = ("res_x", "compress_space_res", "res_x", "compress_time_res", "res_x", "compress_all_res", "res_x",
             "compress_all_res", "res_x")
    encoder = [[k, {"num_layers": v.layers_per_block[i // 2]} if k == "res_x" else {"multiplier": 2}]
               for i, k in enumerate(kinds)]
    decoder = []
    for i, n in enumerate(v.decoder_layers_per_block):
        decoder.append(["res_x", {"num_layers": n, "inject_noise": False}])
        if i < 3:
            decoder.append(["compress_all", {"residual": True, "multiplier": 2}])
    return {"_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3,
            "latent_channels": v.latent_channels, "encoder_blocks": encoder, "decoder_blocks": decoder,
            "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
            "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": False,
            "encoder_base_channels": v.block_out_channels[0] // 2, "decoder_base_channels": v.decoder_block_out_channels[0] // 2}


def _audio_config(pipe) -> dict:
    a = pipe.audio_vae.config
    ddconfig = {"double_z": True, "mel_bins": a.mel_bins, "z_channels": a.latent_channels, "resolution": a.resolution,
                "downsample_time": False, "in_channels": a.in_channels, "out_ch": a.output_channels,
                "ch": a.base_channels, "ch_mult": list(a.ch_mult), "num_res_blocks": a.num_res_blocks,
                "attn_resolutions": [], "dropout": 0.0, "mid_block_add_attention": a.mid_block_add_attention,
                "norm_type": a.norm_type, "causality_axis": a.causality_axis}
    return {"model": {"params": {"ddconfig": ddconfig, "sampling_rate": a.sample_rate}},
            "preprocessing": {"stft": {"filter_length": 1024, "hop_length": a.mel_hop_length}}}


def _vocoder_config(pipe) -> dict:
    v = pipe.vocoder.config
    return {"resblock_kernel_sizes": list(v.resnet_kernel_sizes), "upsample_rates": list(v.upsample_factors),
            "upsample_kernel_sizes": list(v.upsample_kernel_sizes),
            "resblock_dilation_sizes": [list(d) for d in v.resnet_dilations], "upsample_initial_channel": v.hidden_channels,
            "stereo": True, "resblock": "1", "activation": "snake", "use_bias_at_final": True, "use_tanh_at_final": True}


if __name__ == "__main__":
    main()

"""The shape of a denoiser, read from a single file's header or from a diffusers config, so that a
file can be matched to the config folder it fits (`carried.choose`). One reader pair per family the
pack carries configs for: Wan (the original Wan key names ComfyUI files use), FLUX.1 and FLUX.2 (BFL's), LTX-2
(Lightricks' original names, as its ComfyUI checkpoints hold them), Z-Image (its original names or
diffusers') and Qwen-Image (diffusers' names, which its ComfyUI files hold).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from .inspect import SingleFileError, SingleFileInfo
from .quant_entries import PACKED_QUANT, read_quant_layers

PREFIX = re.compile(r"^(model\.diffusion_model\.|diffusion_model\.)")
WAN_EXTRAS = (("vace_blocks.", "VACE"), ("motion_encoder.", "Animate"))  # key prefix -> what it is


@dataclass(frozen=True)
class WanShape:
    """What tells Wan transformers apart: width, depth, channels, feed-forward size, image embedding
    (and its frame positions: FLF2V's), VACE or Animate blocks."""

    width: int
    layers: int
    in_channels: int
    out_channels: int
    ffn: int
    image_dim: int | None
    frame_positions: bool = False
    extra: str | None = None  # "VACE" / "Animate" blocks (a file's; no carried config has them)

    def __str__(self) -> str:
        image = f", image embedding {self.image_dim}" if self.image_dim else ""
        image += " with frame positions (FLF2V)" if self.frame_positions else ""
        extra = f", {self.extra} blocks" if self.extra else ""
        return (f"{self.layers} blocks of width {self.width} (feed-forward {self.ffn}), {self.in_channels} "
                f"input / {self.out_channels} output channels{image}{extra}")


@dataclass(frozen=True)
class FluxShape:
    """What tells FLUX.1 and FLUX.2 transformers apart: width, double / single blocks, channels, text
    and pooled widths (FLUX.2 has no pooled input: 0), guidance input."""

    width: int
    double: int
    single: int
    in_channels: int
    text_dim: int
    pooled_dim: int
    guidance: bool

    def __str__(self) -> str:
        return (f"{self.double} double and {self.single} single blocks of width {self.width}, {self.in_channels} "
                f"input channels, {'a' if self.guidance else 'no'} guidance input")


@dataclass(frozen=True)
class Ltx2Shape:
    """What tells LTX-2 transformers apart: video / audio width and channels, depth, caption width,
    and LTX-2.3's gated attention (its files; no carried config has it)."""

    width: int
    in_channels: int
    audio_width: int
    audio_in_channels: int
    layers: int
    caption_channels: int
    gated: bool = False

    def __str__(self) -> str:
        gated = ", gated attention (LTX-2.3)" if self.gated else ""
        return (f"{self.layers} blocks of width {self.width} (audio {self.audio_width}), {self.in_channels} video / "
                f"{self.audio_in_channels} audio input channels, captions of width {self.caption_channels}{gated}")


@dataclass(frozen=True)
class ZImageShape:
    """What tells Z-Image transformers apart: width, main and refiner depth, the values of a latent
    patch (channels × patch area: 16 × 2 × 2 for Z-Image Turbo), caption width."""

    width: int
    layers: int
    refiners: int
    patch_values: int
    caption_dim: int

    def __str__(self) -> str:
        return (f"{self.layers} blocks of width {self.width} ({self.refiners} refiner blocks), {self.patch_values} "
                f"values a latent patch, captions of width {self.caption_dim}")


@dataclass(frozen=True)
class QwenImageShape:
    """What tells Qwen-Image transformers apart: width, depth, input channels, text width, and the
    edit variants' extras (2511's zero-timestep reference index, Layered's extra time input), as
    ComfyUI's model detection tells them."""

    width: int
    layers: int
    in_channels: int
    text_dim: int
    extra: str | None = None

    def __str__(self) -> str:
        extra = f", {self.extra}" if self.extra else ""
        return (f"{self.layers} blocks of width {self.width}, {self.in_channels} input channels, text of width "
                f"{self.text_dim}{extra}")


Shape = WanShape | FluxShape | Ltx2Shape | ZImageShape | QwenImageShape
QWEN_IMAGE_EXTRAS = (("__index_timestep_zero__", "a zero-timestep reference (Qwen-Image-Edit-2511)"),
                     ("time_text_embed.addition_t_embedding.weight", "an extra time input (Qwen-Image-Layered)"))


def file_shape(info: SingleFileInfo) -> Shape:
    """The shape of the denoiser ``info`` describes (its family's reader); a layer stored two weights
    a byte (W4A8, W4A4, NVFP4) is read at its width, twice its stored weight's."""
    packed = {f"{layer}.weight" for layer, conf in read_quant_layers(info).items()
              if isinstance(conf, dict) and conf.get("format") in PACKED_QUANT}
    shapes = {PREFIX.sub("", k): (s[0], s[1] * 2) if k in packed and len(s) == 2 else s for k, s in info.shapes.items()}
    try:
        return FILE_READERS[info.family](shapes)
    except (KeyError, ValueError, IndexError) as exc:
        raise SingleFileError(f"{info.path} has no {info.family} transformer key {exc}: it is not a denoiser the "
                              "pack's configs fit; pick a diffusers config folder of its model") from exc


def config_shape(folder: Path, family: str) -> Shape | None:
    """The shape of the transformer configured in ``folder`` (its config.json), as its family reads it."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
        return CONFIG_READERS[family](config)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wan(shapes: dict[str, tuple[int, ...]]) -> WanShape:
    width, in_channels, *patch = shapes["patch_embedding.weight"]
    image = shapes.get("img_emb.proj.0.weight")
    extra = next((name for prefix, name in WAN_EXTRAS if any(k.startswith(prefix) for k in shapes)), None)
    return WanShape(width, _count(shapes, "blocks."), in_channels,
                    shapes["head.head.weight"][0] // max(1, math.prod(patch)), shapes["blocks.0.ffn.0.weight"][0],
                    image[0] if image else None, "img_emb.emb_pos" in shapes, extra)


def _wan_config(c: dict) -> WanShape:
    return WanShape(c["num_attention_heads"] * c["attention_head_dim"], c["num_layers"], c["in_channels"],
                    c["out_channels"], c["ffn_dim"], c.get("image_dim"), c.get("pos_embed_seq_len") is not None)


def _flux(shapes: dict[str, tuple[int, ...]]) -> FluxShape:
    width, in_channels = shapes["img_in.weight"]
    return FluxShape(width, _count(shapes, "double_blocks."), _count(shapes, "single_blocks."), in_channels,
                     shapes["txt_in.weight"][1], shapes["vector_in.in_layer.weight"][1],
                     "guidance_in.in_layer.weight" in shapes)


def _flux_config(c: dict) -> FluxShape:
    return FluxShape(c["num_attention_heads"] * c["attention_head_dim"], c["num_layers"], c["num_single_layers"],
                     c["in_channels"], c["joint_attention_dim"], c["pooled_projection_dim"], bool(c["guidance_embeds"]))


def _flux2(shapes: dict[str, tuple[int, ...]]) -> FluxShape:
    width, in_channels = shapes["img_in.weight"]
    return FluxShape(width, _count(shapes, "double_blocks."), _count(shapes, "single_blocks."), in_channels,
                     shapes["txt_in.weight"][1], 0, "guidance_in.in_layer.weight" in shapes)


def _flux2_config(c: dict) -> FluxShape:
    return FluxShape(c["num_attention_heads"] * c["attention_head_dim"], c["num_layers"], c["num_single_layers"],
                     c["in_channels"], c["joint_attention_dim"], 0, bool(c["guidance_embeds"]))


def _ltx2(shapes: dict[str, tuple[int, ...]]) -> Ltx2Shape:
    width, in_channels = shapes["patchify_proj.weight"]
    audio_width, audio_in = shapes["audio_patchify_proj.weight"]
    return Ltx2Shape(width, in_channels, audio_width, audio_in, _count(shapes, "transformer_blocks."),
                     shapes["caption_projection.linear_1.weight"][1],
                     any(k.endswith("attn1.to_gate_logits.weight") for k in shapes))


def _ltx2_config(c: dict) -> Ltx2Shape:
    return Ltx2Shape(c["num_attention_heads"] * c["attention_head_dim"], c["in_channels"],
                     c["audio_num_attention_heads"] * c["audio_attention_head_dim"], c["audio_in_channels"],
                     c["num_layers"], c["caption_channels"], bool(c.get("gated_attn")))


def _z_image(shapes: dict[str, tuple[int, ...]]) -> ZImageShape:
    width, patch_values = shapes.get("x_embedder.weight") or shapes["all_x_embedder.2-1.weight"]
    return ZImageShape(width, _count(shapes, "layers."), _count(shapes, "noise_refiner."), patch_values,
                       shapes["cap_embedder.1.weight"][1])


def _z_image_config(c: dict) -> ZImageShape:
    patch, frames = c["all_patch_size"][0], c["all_f_patch_size"][0]
    return ZImageShape(c["dim"], c["n_layers"], c["n_refiner_layers"], c["in_channels"] * patch * patch * frames,
                       c["cap_feat_dim"])


def _qwen_image(shapes: dict[str, tuple[int, ...]]) -> QwenImageShape:
    width, in_channels = shapes["img_in.weight"]
    extra = next((what for key, what in QWEN_IMAGE_EXTRAS if key in shapes), None)
    return QwenImageShape(width, _count(shapes, "transformer_blocks."), in_channels, shapes["txt_in.weight"][1], extra)


def _qwen_image_config(c: dict) -> QwenImageShape:
    extra = (QWEN_IMAGE_EXTRAS[0][1] if c.get("zero_cond_t") else
             QWEN_IMAGE_EXTRAS[1][1] if c.get("use_additional_t_cond") else None)
    return QwenImageShape(c["num_attention_heads"] * c["attention_head_dim"], c["num_layers"], c["in_channels"],
                          c["joint_attention_dim"], extra)


def _count(shapes: dict[str, tuple[int, ...]], prefix: str) -> int:
    return len({k.split(".")[1] for k in shapes if k.startswith(prefix)})


FILE_READERS = {"wan": _wan, "flux": _flux, "flux2": _flux2, "ltx2": _ltx2, "z-image": _z_image, "qwen-image": _qwen_image}
CONFIG_READERS = {"wan": _wan_config, "flux": _flux_config, "flux2": _flux2_config, "ltx2": _ltx2_config, "z-image": _z_image_config,
                  "qwen-image": _qwen_image_config}

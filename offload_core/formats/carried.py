"""Configs the pack carries (Wan 2.1 / 2.2: configs-only copies of the Wan-AI diffusers folders,
written by ``tools/write_carried_configs.py``), so a user holding only ComfyUI single files needs
no diffusers folder: the one whose transformer fits the denoiser file's shapes is picked, and the
tokenizer comes from the text-encoder file (Comfy-Org's UMT5 files carry its sentencepiece model,
which is what ComfyUI's own Wan tokenizer reads).
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..log import get_logger
from .inspect import SingleFileError, SingleFileInfo, describe_keys, inspect_safetensors

log = get_logger("single_file")

ROOT = Path(__file__).with_name("carried_configs")
SPIECE = "spiece_model"  # ComfyUI's name for a sentencepiece model a text-encoder file carries
WAN_PREFIX = re.compile(r"^(model\.diffusion_model\.|diffusion_model\.)")


@dataclass(frozen=True)
class WanShape:
    """What tells Wan transformers apart: width, depth, channels, feed-forward size, image embedding."""

    width: int
    layers: int
    in_channels: int
    out_channels: int
    ffn: int
    image_dim: int | None

    def __str__(self) -> str:
        image = f", image embedding {self.image_dim}" if self.image_dim else ""
        return (f"{self.layers} blocks of width {self.width} (feed-forward {self.ffn}), {self.in_channels} "
                f"input / {self.out_channels} output channels{image}")


def carried() -> list[Path]:
    """The config folders the pack carries, by name."""
    return sorted(p for p in ROOT.iterdir() if (p / "model_index.json").is_file()) if ROOT.is_dir() else []


def by_name(name: str) -> Path:
    """The carried config folder called ``name``."""
    found = [p for p in carried() if p.name == name]
    if not found:
        raise SingleFileError(f"the pack carries no config folder {name!r}: it carries "
                              f"{', '.join(p.name for p in carried())}")
    return found[0]


def pick(denoiser: Path, two_experts: bool, root: Path | None = None) -> Path:
    """The carried config folder (under ``root``, the pack's by default) that fits ``denoiser`` (see `choose`)."""
    folders = sorted(p for p in Path(root).iterdir() if (p / "model_index.json").is_file()) if root else carried()
    chosen = choose(_info(Path(denoiser)), two_experts, folders)
    log.info("%s: the pack's %s configs", Path(denoiser).name, chosen.name)
    return chosen


def choose(info: SingleFileInfo, two_experts: bool, folders: list[Path]) -> Path:
    """The one of ``folders`` whose transformer has the shape of the denoiser ``info`` describes and
    which has a second expert exactly when ``two_experts`` (Wan 2.2 A14B); a file of another family,
    or of no carried shape, is refused saying what it is."""
    if info.family != "wan":
        raise SingleFileError(f"{info.path} looks like {info.looks_like}: the pack carries configs for Wan 2.1 / 2.2 "
                              "only; pick a diffusers config folder of its family (models/diffusers)")
    shape = wan_shape(info)
    fits = [f for f in folders if _config_shape(f / "transformer") == shape]
    chosen = [f for f in fits if (f / "transformer_2").is_dir() == two_experts]
    if not chosen:
        hint = ("; Wan 2.2 A14B: its high-noise file goes in denoiser, its low-noise one in denoiser_2"
                if fits and not two_experts else "; leave denoiser_2 at 'none'" if fits else "")
        raise SingleFileError(f"{info.path} is a Wan denoiser of {shape}{' with a second expert' * two_experts}: "
                              f"none of the configs the pack carries ({', '.join(f.name for f in folders)}) fits it"
                              f"{hint}; else pick a diffusers config folder of its model")
    return chosen[0]


def _info(path: Path) -> SingleFileInfo:
    if not path.is_file():
        raise SingleFileError(f"{path} does not exist: pick a file from models/diffusion_models")
    if path.suffix.lower() == ".gguf":
        from .gguf import inspect_gguf

        return describe_keys(path, inspect_gguf(path).shapes)
    return inspect_safetensors(path)


def wan_shape(info: SingleFileInfo) -> WanShape:
    """The shape of a Wan transformer from its ComfyUI key names (the original Wan layout)."""
    shapes = {WAN_PREFIX.sub("", k): s for k, s in info.shapes.items()}
    try:
        width, in_channels = shapes["patch_embedding.weight"][:2]
        patch = shapes["patch_embedding.weight"][2:]
        out_channels = shapes["head.head.weight"][0] // max(1, math.prod(patch))
        ffn = shapes["blocks.0.ffn.0.weight"][0]
    except (KeyError, ValueError) as exc:
        raise SingleFileError(f"{info.path} has no Wan transformer key {exc}: it is not a Wan denoiser the pack's "
                              "configs fit; pick a diffusers config folder of its model") from exc
    layers = len({k.split(".")[1] for k in shapes if k.startswith("blocks.")})
    image = shapes.get("img_emb.proj.0.weight")
    return WanShape(width, layers, in_channels, out_channels, ffn, image[0] if image else None)


def _config_shape(folder: Path) -> WanShape | None:
    try:
        c = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        return WanShape(c["num_attention_heads"] * c["attention_head_dim"], c["num_layers"], c["in_channels"],
                        c["out_channels"], c["ffn_dim"], c.get("image_dim"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def tokenizer_from_file(path: Path, cls_name: str, what: str) -> Any:
    """The ``cls_name`` tokenizer (T5TokenizerFast for Wan's UMT5) built by transformers' own
    converter from the sentencepiece model text-encoder file ``path`` carries; ``what`` names the
    config folder that lacks one, for the error."""
    import transformers

    path = Path(path)
    model = _spiece(path)
    if model is None:
        raise SingleFileError(f"{what} has no tokenizer and {path.name} carries none (no {SPIECE} entry, or in a GGUF file "
                              "no T5 tokenizer metadata): pick a "
                              "text-encoder file that carries it (Comfy-Org's umt5_xxl_fp8_e4m3fn_scaled does) or "
                              "a diffusers config folder with a tokenizer")
    cls = getattr(transformers, cls_name, None)
    if not isinstance(cls, type):
        raise SingleFileError(f"{what}: tokenizer class {cls_name!r} is not in this transformers version")
    with tempfile.TemporaryDirectory(prefix="offload-tokenizer-") as tmp:
        (Path(tmp) / "spiece.model").write_bytes(model)
        try:
            tokenizer = cls.from_pretrained(tmp, extra_ids=0, model_max_length=512)
        except Exception as exc:  # no sentencepiece / protobuf, or a damaged model
            raise SingleFileError(f"the tokenizer {path.name} carries could not be read ({type(exc).__name__}: "
                                  f"{exc}); the pack needs the sentencepiece and protobuf packages") from exc
    log.info("%s: tokenizer read from its sentencepiece model (%d pieces)", path.name, len(tokenizer))
    return tokenizer


def _spiece(path: Path) -> bytes | None:
    """The sentencepiece model a text-encoder file carries: a safetensors file's ``spiece_model``
    entry, or a GGUF file's tokenizer metadata (`gguf_text_encoder.gguf_spiece`)."""
    if path.suffix.lower() == ".gguf":
        from .gguf_text_encoder import gguf_spiece

        return gguf_spiece(path)
    keys = [k for k in inspect_safetensors(path).tokenizers if k.rsplit(".", 1)[-1] == SPIECE]
    if not keys:
        return None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.get_tensor(keys[0]).numpy().tobytes()

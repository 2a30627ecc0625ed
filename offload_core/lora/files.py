"""Reading a LoRA file into per-layer low-rank factors, through diffusers' own key conversions.

Why not diffusers' ``load_lora_weights``: it injects peft layers into the model, which fights the
engine's hooks and master copies. Only the *reading* half of diffusers is used: the pipeline's
``lora_state_dict`` turns kohya / ComfyUI / musubi / original-repo keys into diffusers/peft keys,
and the scaling follows what diffusers would build a ``LoraConfig`` from (the file's adapter
metadata, network alphas, else alpha = rank). Files are opened read-only, as safetensors only
(a pickle is never unpickled on a user's behalf).

Musubi/kohya Wan files (``lora_unet_blocks_N_self_attn_q...``) are renamed in memory to the
original Wan layout (``diffusion_model.blocks.N.self_attn.q...``) before diffusers converts them:
diffusers' musubi converter requires every block to carry self-attention, cross-attention and
feed-forward factors (an attention-only file fails with a KeyError), while its converter for the
original layout takes any subset, with the same alpha scaling.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from peft.utils.other import get_pattern_key
from safetensors import SafetensorError, safe_open

from ..components import component_names
from ..log import get_logger

log = get_logger("lora")

METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
# Key tails after diffusers' conversion (and the older spellings its loaders still accept).
TAILS: dict[str, str] = {
    ".lora_A.weight": "down", ".lora_B.weight": "up", ".lora_B.bias": "bias",
    ".lora_down.weight": "down", ".lora_up.weight": "up",
    ".lora.down.weight": "down", ".lora.up.weight": "up",
    ".lora_linear_layer.down.weight": "down", ".lora_linear_layer.up.weight": "up",
}
RAW_MARKERS = ("lora", ".alpha", ".diff", ".diff_b")  # a raw key that can belong to a LoRA
LYCORIS = ("lokr_", "hada_")  # other low-rank schemes: factors that are not A/B
# A musubi Wan block module, and its name in the original Wan layout (diffusion_model.*).
MUSUBI_WAN = re.compile(r"lora_unet_blocks_(\d+)_(?:(self_attn|cross_attn)_(q|k|v|o|k_img|v_img)|ffn_(0|2))")


class LoraError(ValueError):
    """A file that cannot be used as a LoRA for this model; the message names the file."""


@dataclass(frozen=True)
class LoraLayer:
    """One layer's factors: ``delta W = scale * up @ down`` (``bias`` is a bias delta, same scale)."""

    down: torch.Tensor | None
    up: torch.Tensor | None
    bias: torch.Tensor | None
    scale: float


@dataclass(frozen=True)
class LoraFile:
    path: str
    layers: dict[str, dict[str, LoraLayer]]  # component -> module path -> layer
    skipped: int  # tensors of the file that are not usable LoRA factors


def identity(path: str | os.PathLike[str]) -> tuple[str, int, int]:
    """What makes two reads of a file equal: its real path, size and modification time."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return real, st.st_size, st.st_mtime_ns


def read_lora(path: str | os.PathLike[str], pipe: object) -> LoraFile:
    """Read ``path`` as a LoRA for ``pipe`` (converted to diffusers keys, grouped by component)."""
    raw, metadata = _load(Path(path))
    if not any(m in k.lower() for k in raw for m in RAW_MARKERS):
        raise LoraError(f"{path} is not a LoRA: none of its {len(raw)} tensors is a LoRA weight "
                        f"(e.g. {next(iter(raw), '-')!r}); full model weights belong in models/diffusers")
    if any(m in k for k in raw for m in LYCORIS):
        raise LoraError(f"{path} is a LyCORIS LoKr/LoHa file: only LoRA (low-rank A/B) files are supported")
    state, alphas = _convert(raw, pipe, path)
    names = component_names(pipe)
    default = next((n for n in ("transformer", "unet") if n in names), None)
    factors: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    skipped = 0
    for key, tensor in state.items():
        tail = next((t for t in TAILS if key.endswith(t)), None)
        if tail is None:
            skipped += not key.endswith(".alpha")
            continue
        comp, _, rest = key.partition(".")
        if comp not in names:
            comp, rest = default or comp, key
        factors.setdefault((comp, rest[: -len(tail)]), {})[TAILS[tail]] = tensor
    alphas = {**alphas, **_raw_alphas(state)}
    layers: dict[str, dict[str, LoraLayer]] = {}
    for (comp, module), parts in factors.items():
        if ("down" in parts) != ("up" in parts):
            skipped += 1
            continue
        scale = _scale(comp, module, parts, metadata, alphas)
        layers.setdefault(comp, {})[module] = LoraLayer(parts.get("down"), parts.get("up"), parts.get("bias"), scale)
    return LoraFile(str(path), layers, skipped)


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    if not path.is_file():
        raise LoraError(f"LoRA file {path} does not exist")
    if path.suffix != ".safetensors":
        raise LoraError(f"{path} is not a .safetensors file: LoRAs are read from safetensors only "
                        "(pickled .pt/.ckpt files can run code); convert it to safetensors")
    try:
        with safe_open(str(path), "pt", device="cpu") as f:
            raw = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
            header = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraError(f"{path} cannot be read as safetensors ({exc}): it is truncated or not a LoRA file") from exc
    try:
        metadata = json.loads(header.get(METADATA_KEY) or "{}")
    except json.JSONDecodeError:
        log.warning("%s: its %s header is not JSON; scaling from the tensors alone", path, METADATA_KEY)
        metadata = {}
    return raw, metadata if isinstance(metadata, dict) else {}


def _convert(raw: dict[str, torch.Tensor], pipe: object, path: object) -> tuple[dict, dict]:
    """diffusers' own conversion for this pipeline class: (state dict, network alphas)."""
    convert = getattr(type(pipe), "lora_state_dict", None)
    if convert is None:
        return raw, {}
    raw = _musubi_wan_as_original(raw, pipe)
    kwargs = {"return_alphas": True} if "return_alphas" in inspect.signature(convert).parameters else {}
    try:
        out = convert(dict(raw), **kwargs)
    except Exception as exc:  # the converters raise anything from KeyError to ValueError
        raise LoraError(f"{path}: diffusers cannot read it as a LoRA for {type(pipe).__name__} "
                        f"({type(exc).__name__}: {exc})") from exc
    if isinstance(out, tuple):
        return out[0], (out[1] if len(out) > 1 and isinstance(out[1], dict) else {})
    return out, {}


def _musubi_wan_as_original(raw: dict[str, torch.Tensor], pipe: object) -> dict[str, torch.Tensor]:
    """A Wan pipeline's musubi keys under the original layout's names (same tensors); else ``raw``."""
    from diffusers.loaders import WanLoraLoaderMixin

    if not isinstance(pipe, WanLoraLoaderMixin) or not raw or not all(k.startswith("lora_unet_") for k in raw):
        return raw
    renamed = {}
    for key, tensor in raw.items():
        module, dot, tail = key.partition(".")
        match = MUSUBI_WAN.fullmatch(module)
        if match is None:  # a module the original layout does not name: diffusers' own path decides
            return raw
        block, attn, proj, ffn = match.groups()
        name = f"blocks.{block}.{attn}.{proj}" if attn else f"blocks.{block}.ffn.{ffn}"
        renamed[f"diffusion_model.{name}{dot}{tail}"] = tensor
    return renamed


def _raw_alphas(state: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v) for k, v in state.items() if k.endswith(".alpha") and v.numel() == 1}


def _scale(comp: str, module: str, parts: dict[str, torch.Tensor], metadata: dict[str, object],
           alphas: dict[str, float]) -> float:
    """alpha / rank (alpha / sqrt(rank) with rsLoRA); alpha from metadata, network alphas, or rank."""
    down = parts.get("down")
    if down is None:
        return 1.0
    rank = down.shape[0]
    config = {k.removeprefix(f"{comp}."): v for k, v in metadata.items() if k.startswith(f"{comp}.")}
    if config:
        pattern = config.get("alpha_pattern") or {}
        key = get_pattern_key(list(pattern), module)
        alpha = float(pattern.get(key, config.get("lora_alpha", rank)))
        return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    alpha = alphas.get(f"{comp}.{module}.alpha", alphas.get(f"{module}.alpha"))
    return float(alpha) / rank if alpha is not None else 1.0

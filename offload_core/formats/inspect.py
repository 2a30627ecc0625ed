"""What a single file is, read from its header only: format, fp8 scales, ComfyUI quant entries,
and what it looks like (a Wan/Flux/... denoiser, a text encoder, a VAE, a LoRA).

Why header only: a user's file is tens of GB; choosing the loading path, and refusing a wrong file
by name, must cost milliseconds. The family comes from diffusers' own detector
(`infer_diffusers_model_type`, the key names `from_single_file` uses), run on meta tensors built
from the header; text encoders, VAEs and LoRAs are told by their key names first.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
FP8_NAMES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E8M0": torch.float8_e8m0fnu,  # (MXFP8's block scales)
    **FP8_NAMES,
}
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
INPUT_SCALE_SUFFIXES = (".scale_input", ".input_scale")
QUANT_SUFFIX = ".comfy_quant"
TOKENIZER_KEYS = ("spiece_model", "tokenizer_json", "tekken_model")  # tokenizers ComfyUI's files carry (comfy/sd.py)
VARIANT_FLAGS = ("__index_timestep_zero__",)  # empty tensors that tell ComfyUI's model detection a variant (Qwen-Image-Edit-2511)
QUANT_METADATA = "_quantization_metadata"
# (pattern on any key, what the file looks like, its role): first match wins; before the denoiser
# detector, since a text encoder never carries a denoiser's keys.
KEY_SIGNS: tuple[tuple[str, str, str], ...] = (
    (r"(^|\.)lora_(A|B|up|down)\.|\.lora\.(up|down)\.", "a LoRA", "lora"),
    (r"(^|\.)encoder\.block\.\d+\.layer\.\d+\.SelfAttention\.", "a T5/UMT5 text encoder", "text_encoder"),
    (r"^enc\.blk\.\d+\.attn_q\.", "a T5/UMT5 text encoder (llama.cpp names)", "text_encoder"),
    (r"(^|\.)text_model\.encoder\.layers\.\d+\.", "a CLIP text encoder", "text_encoder"),
    (r"(^|\.)vision_model\.encoder\.layers\.\d+\.", "a CLIP vision (image) encoder", "image_encoder"),
    (r"^embeddings\.patch_embedding\.", "a CLIP vision (image) encoder", "image_encoder"),  # as transformers 5 saves it
    (
        r"(^|\.)(language_model\.)?(model\.)?layers\.\d+\.self_attn\.(q_proj|qkv_proj)\.",
        "a Qwen/Llama/Gemma-style language model (a text encoder)",
        "text_encoder",
    ),
    (r"(^|\.)decoder\.middle\.0\.residual\.0\.gamma$", "a Wan VAE", "vae"),
    (r"(^|\.)decoder\.(up_blocks|up)\.\d+\..*(conv|resnets)", "a VAE", "vae"),
)
DENOISER_FAMILIES: tuple[tuple[str, str], ...] = (  # diffusers model type prefix -> family
    ("wan", "wan"),
    ("flux-2", "flux2"),
    ("flux-3", "flux3"),
    ("flux", "flux"),
    ("chroma", "chroma"),
    ("ltx2", "ltx2"),
    ("ltx-video", "ltx-video"),
    ("minimax-h3", "minimax_h3"),
    ("hunyuan-video", "hunyuan-video"),
    ("mochi", "mochi"),
    ("sd3", "sd3"),
    ("sd35", "sd3"),
    ("auraflow", "auraflow"),
    ("lumina2", "lumina2"),
    ("sana", "sana"),
    ("hidream", "hidream"),
    ("cosmos", "cosmos"),
    ("z-image", "z-image"),
    ("qwen-image-2", "qwen-image-2"),  # (2.1: another transformer class)
    ("qwen-image", "qwen-image"),
    ("krea2", "krea2"),
)


# Denoisers whose files diffusers' detector does not name though its loader reads them as they are
# (in its own key names): the key only their files hold, as ComfyUI's model_detection tells them.
OWN_SIGNS: tuple[tuple[str, str], ...] = (("txt_norm.weight", "qwen-image"),)  # Qwen-Image (2.1: diffusers')
CHECKPOINT_DENOISER = "model.diffusion_model."  # a checkpoint's denoiser, in ComfyUI's key names


class SingleFileError(ValueError):
    """A single file the pack cannot run as asked; the message names the file and what it looks like."""


@dataclass
class SingleFileInfo:
    """A single file as its header describes it."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    metadata: dict[str, str] = field(default_factory=dict)
    scales: dict[str, str] = field(default_factory=dict)  # layer -> key of its per-tensor weight scale
    input_scales: list[str] = field(default_factory=list)  # keys of static input scales (fp8 matmuls)
    marker: str | None = None  # the `scaled_fp8` key, if any
    quant_keys: list[str] = field(default_factory=list)  # `<layer>.comfy_quant` keys
    tokenizers: list[str] = field(default_factory=list)  # keys of a tokenizer the file carries (uint8 bytes)
    looks_like: str = "an unknown model"
    role: str = "unknown"  # denoiser / text_encoder / image_encoder / vae / lora / unknown
    family: str | None = None  # of a denoiser: wan, flux, ltx2, ...
    model_type: str | None = None  # diffusers' name for it (wan-t2v-1.3B, flux-dev, ...)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def fp8(self) -> torch.dtype | None:
        """The fp8 dtype of the file's weights (one only), or None when it holds none."""
        found = {d for k, d in self.dtypes.items() if d in FP8_NAMES.values() and k != self.marker}
        if len(found) > 1:
            raise SingleFileError(
                f"{self.path}: mixes fp8 formats {sorted(map(str, found))}; one fp8 dtype per "
                "file is supported"
            )
        return found.pop() if found else None

    @property
    def quantized(self) -> bool:
        """fp8 weights (scaled or not) or ComfyUI's self-describing quant entries."""
        return self.fp8 is not None or bool(self.scales or self.quant_keys) or QUANT_METADATA in self.metadata

    @property
    def format(self) -> str:
        """bf16 / fp16 / fp32 / fp8_e4m3fn / fp8_e4m3fn_scaled / comfy_quant, for logs and errors."""
        if self.quant_keys or QUANT_METADATA in self.metadata:
            return "comfy_quant"
        fp8 = self.fp8
        if fp8 is not None:
            name = "fp8_" + str(fp8).removeprefix("torch.float8_")
            return f"{name}_scaled" if self.scales else name
        floats = [d for d in self.dtypes.values() if d.is_floating_point]
        common = max(set(floats), key=floats.count) if floats else None
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(common, str(common))


def read_header(path: Path) -> tuple[dict, dict[str, str]]:
    """The tensor entries and the ``__metadata__`` of a safetensors file, checked against its size
    (a truncated or garbage file fails here, by name)."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else 0
        if not 0 < length <= min(size - 8, MAX_HEADER):
            raise SingleFileError(_damaged(path, f"its {size} bytes cannot hold the header it announces"))
        try:
            header = json.loads(f.read(length))
            metadata = header.pop("__metadata__", None) or {}
            end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
            for key, v in header.items():
                if v["dtype"] not in ST_DTYPES:
                    raise SingleFileError(
                        f"{path}: tensor {key} has dtype {v['dtype']}, which this pack cannot "
                        f"load (known: {', '.join(ST_DTYPES)})"
                    )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            if isinstance(exc, SingleFileError):
                raise
            raise SingleFileError(_damaged(path, f"its header is not valid ({exc})")) from exc
    if 8 + length + end != size:
        raise SingleFileError(
            _damaged(path, f"its header describes {8 + length + end} bytes, the file has {size}")
        )
    return header, dict(metadata)


def _damaged(path: Path, why: str) -> str:
    return (
        f"{path} is not a readable safetensors file (truncated or corrupt): {why}; download this file again"
    )


def inspect_safetensors(path: Path) -> SingleFileInfo:
    """A safetensors single file described from its header (tensor data is not read, except the
    few bytes of ComfyUI's ``comfy_quant`` entries)."""
    header, metadata = read_header(path)
    info = SingleFileInfo(
        Path(path),
        {k: tuple(v["shape"]) for k, v in header.items()},
        {k: ST_DTYPES[v["dtype"]] for k, v in header.items()},
        metadata,
    )
    for key in header:
        if key == "scaled_fp8" or key.endswith(".scaled_fp8"):
            info.marker = key
        elif key.endswith(SCALE_SUFFIXES):
            info.scales[key.rsplit(".", 1)[0]] = key
        elif key.endswith(INPUT_SCALE_SUFFIXES):
            info.input_scales.append(key)
        elif key.endswith(QUANT_SUFFIX):
            info.quant_keys.append(key)
        elif key.rsplit(".", 1)[-1] in TOKENIZER_KEYS:
            info.tokenizers.append(key)
    _identify(info)
    return info


def describe_keys(path: Path, shapes: dict[str, tuple[int, ...]]) -> SingleFileInfo:
    """What a file holding tensors of ``shapes`` looks like (role, family) from its key names and
    shapes alone: a GGUF file, whose header the GGUF reader gives."""
    info = SingleFileInfo(path, dict(shapes), {k: torch.bfloat16 for k in shapes})
    _identify(info)
    return info


def inspect_file(path: Path) -> SingleFileInfo:
    """A safetensors or GGUF single file described from its header (`inspect_safetensors`, or the
    GGUF reader's shapes through `describe_keys`)."""
    if Path(path).suffix.lower() == ".gguf":
        from .gguf import inspect_gguf

        return describe_keys(Path(path), inspect_gguf(path).shapes)
    return inspect_safetensors(path)


def _identify(info: SingleFileInfo) -> None:
    """Role and family from the key names and shapes; a checkpoint (a denoiser under ComfyUI's
    ``model.diffusion_model.`` beside its VAE and others: LTX-2's) is read for its denoiser first."""
    keys = [k for k in info.shapes if k != info.marker and k not in info.tokenizers]
    if any(k.startswith(CHECKPOINT_DENOISER) for k in keys) and _denoiser(info):
        return
    for pattern, looks_like, role in KEY_SIGNS:
        if any(re.search(pattern, k) for k in keys):
            info.looks_like, info.role = looks_like, role
            return
    _denoiser(info)


def _denoiser(info: SingleFileInfo) -> bool:
    model_type = _diffusers_model_type(info)
    for prefix, family in DENOISER_FAMILIES:
        if model_type and model_type.startswith(prefix):
            info.model_type, info.family, info.role = model_type, family, "denoiser"
            info.looks_like = f"a {family} denoiser"
            return True
    return False


def _diffusers_model_type(info: SingleFileInfo) -> str | None:
    """diffusers' `infer_diffusers_model_type` on meta tensors of the header's shapes; where it
    falls through to its default (``v1``) without the keys of a Stable Diffusion 1 UNet, the
    `OWN_SIGNS` kind of the file or None."""
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES, infer_diffusers_model_type

    meta = {k: torch.empty(s, dtype=info.dtypes[k], device="meta") for k, s in info.shapes.items()}
    try:
        model_type = infer_diffusers_model_type(meta)
    except Exception:  # a detector that reads values (not shapes) cannot run on meta tensors
        return None
    if model_type == "v1" and CHECKPOINT_KEY_NAMES["v1"] not in meta:
        return next((kind for key, kind in OWN_SIGNS if key in meta), None)
    if model_type.startswith("ltx-video") and _ltx2(meta, CHECKPOINT_KEY_NAMES["ltx2"]):
        return "ltx2-dev"  # diffusers 0.42.1 tests LTX-Video's keys, which LTX-2 files also hold, first
    return model_type


def _ltx2(keys: dict, names: list[str]) -> bool:
    """diffusers' LTX-2 keys, with ComfyUI's ``model.diffusion_model.`` prefix or without it."""
    return any(n in keys or n.removeprefix("model.diffusion_model.") in keys for n in names)

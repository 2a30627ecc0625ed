"""Text encoders from llama.cpp GGUF files, which ComfyUI users load with ComfyUI-GGUF: T5 / UMT5
(city96's ``umt5-xxl-encoder-*.gguf`` for Wan, ``t5-v1_1-xxl-encoder-*.gguf`` for Flux), Qwen3
(the ``Qwen3-4B-*.gguf`` files Z-Image users pick in place of ``qwen_3_4b``) and Qwen2.5-VL (the
``Qwen2.5-VL-7B-Instruct-*.gguf`` files Qwen-Image users pick: the language model only, llama.cpp
keeps the vision tower in a separate file, so the model is built without it).

The file names its tensors as llama.cpp does (``enc.blk.0.attn_q.weight``, ``blk.0.attn_q.weight``);
the `gguf` package's own name map for its architecture gives each one its transformers name. diffusers'
GGUF reader loads the packed tensors and its ``GGUFLinear`` layers hold them, dequantised at
compute, as in a GGUF denoiser. The embedding table (as ComfyUI-GGUF does) and T5's ``wo`` layers
(their caller casts the input to the weight's dtype, a packed uint8 here) are decoded at load.
Why not transformers' own GGUF loader: it decodes every weight (10.6 GiB for a UMT5-XXL whose
Q8_0 file holds 5.7).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..log import get_logger
from .gguf import GgufFileError, inspect_gguf
from .inspect import SingleFileError, describe_keys
from .single_file import short_dtype
from .text_encoder_layouts import LAYOUTS, comfy_key, drop_absent

log = get_logger("gguf")

ARCHS = {"t5": "T5ENCODER", "t5encoder": "T5ENCODER", "qwen3": "QWEN3", "qwen2vl": "QWEN2VL"}  # file's -> `gguf`'s
CLASSES = {"T5ENCODER": ("T5EncoderModel", "UMT5EncoderModel"), "QWEN3": ("Qwen3Model", "Qwen3ForCausalLM"),
           "QWEN2VL": ("Qwen2_5_VLForConditionalGeneration",)}
WHAT = {"T5ENCODER": "a T5 text encoder", "QWEN3": "a Qwen3 text encoder",
        "QWEN2VL": "a Qwen2.5-VL language model"}
HEAD = "output.weight"  # llama.cpp's name of a language model's head, which a model without one has no use for
DECODED = ["wo"]  # Linear layers whose caller casts their input to the weight's dtype


def load_gguf_text_encoder(path: Path, config: Path, cls_name: str, dtype: torch.dtype) -> Any:
    """The T5-family text encoder of class ``cls_name`` (config in ``config``) from GGUF file
    ``path``, its Linear layers packed (diffusers' ``GGUFLinear``), computing in ``dtype``."""
    import transformers
    from accelerate import init_empty_weights
    from diffusers.models.model_loading_utils import load_gguf_checkpoint
    from diffusers.quantizers.gguf.utils import _replace_with_gguf_linear

    try:
        info = inspect_gguf(path)
    except GgufFileError as exc:
        raise SingleFileError(str(exc)) from exc
    arch = ARCHS.get(info.arch)
    if arch is None:
        looks = describe_keys(path, info.shapes).looks_like or f"a GGUF {info.arch} model"
        raise SingleFileError(f"{path} looks like {looks}, not a text-encoder file: GGUF text encoders load as "
                              "T5 / UMT5 ('t5encoder'), Qwen3 ('qwen3') and Qwen2.5-VL ('qwen2vl') only")
    if cls_name not in CLASSES[arch]:
        raise SingleFileError(f"{path} is {WHAT[arch]} (GGUF), but the text encoder of {config.parent} is a "
                              f"{cls_name}: pick the text encoder this model uses")
    cls = getattr(transformers, cls_name)
    with init_empty_weights():
        model = cls(cls.config_class.from_pretrained(str(config)))
    state = _renamed(path, load_gguf_checkpoint(str(path)), model, arch)
    _replace_with_gguf_linear(model, dtype, state, modules_to_not_convert=DECODED)
    linears = {n: m for n, m in model.named_modules() if type(m).__name__ == "GGUFLinear"}
    for name, linear in linears.items():  # packed: set as diffusers' GGUF loader sets them (no shape check)
        linear.weight = state.pop(f"{name}.weight")
    state = {k: _decoded(v, dtype, keep32=_keep32(cls, k, dtype)) for k, v in state.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    layout = LAYOUTS.get(cls_name)
    dropped = drop_absent(model, layout) if layout is not None else []  # (Qwen2.5-VL's vision tower)
    empty = [n for n, t in model.state_dict().items() if t.is_meta]
    if empty or result.unexpected_keys:
        raise SingleFileError(f"{path} does not match the {cls_name} config in {config}: missing {empty[:3]}: pick "
                              "the text encoder this model uses")
    log.info("%s: %s text encoder (GGUF %s) loaded with %d packed Linear layers, the rest in %s%s", path.name,
             cls_name, "/".join(info.quantized_types) or "unquantized", len(linears), short_dtype(dtype),
             f", without {', '.join(dropped)}" if dropped else "")
    return model.eval()


def _renamed(path: Path, raw: dict[str, torch.Tensor], model: torch.nn.Module, arch: str) -> dict[str, torch.Tensor]:
    """The file's tensors under the model's names (the `gguf` package's name map of ``arch``, which
    knows a class's ComfyUI layout names: `text_encoder_layouts`), each checked against the shape
    the config gives it; a head, in a file for a model without one, left out."""
    import gguf

    expected = model.state_dict()
    config = model.config.get_text_config()  # (a multimodal model's language model)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], getattr(config, "num_layers", None) or
                                     config.num_hidden_layers)
    layout = LAYOUTS.get(type(model).__name__)
    ours = {names.get_name(comfy_key(layout, k) if layout else k, try_suffixes=(".weight", ".bias")): k
            for k in expected}
    ours.pop(None, None)  # tied weights (encoder.embed_tokens) have no name of their own
    if HEAD in raw and HEAD not in ours:
        log.info("%s: its language-model head left out (%s has none)", path.name, type(model).__name__)
        raw = {k: v for k, v in raw.items() if k != HEAD}
    state, other = {}, []
    for key, tensor in raw.items():
        if key not in ours:
            other.append(key)
            continue
        shape = tuple(getattr(tensor, "quant_shape", tensor.shape))
        if shape != tuple(expected[ours[key]].shape):
            raise SingleFileError(f"{path}: {key} has shape {shape}, the {type(model).__name__} config gives "
                                  f"{tuple(expected[ours[key]].shape)}: pick the text encoder this model uses")
        state[ours[key]] = tensor
    if other:
        raise SingleFileError(f"{path} holds tensors a {type(model).__name__} has no place for "
                              f"({', '.join(sorted(other)[:3])}): pick the text encoder this model uses")
    return state


def _keep32(cls: type, key: str, dtype: torch.dtype) -> bool:
    """transformers' rule: ``_keep_in_fp32_modules`` stay float32 under fp16 (T5's ``wo``)."""
    kept = getattr(cls, "_keep_in_fp32_modules", None) or []
    return dtype == torch.float16 and any(m in key.split(".") for m in kept)


def _decoded(tensor: torch.Tensor, dtype: torch.dtype, keep32: bool) -> torch.Tensor:
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    if isinstance(tensor, GGUFParameter):
        tensor = dequantize_gguf_tensor(tensor)
    return tensor.to(torch.float32 if keep32 else dtype) if tensor.is_floating_point() else tensor


def gguf_spiece(path: Path) -> bytes | None:
    """The sentencepiece model of a T5 / UMT5 GGUF file, rebuilt from the tokenizer metadata
    llama.cpp's converter writes (pieces, scores, types, special ids, normalizer flags and charsmap)
    as ComfyUI-GGUF rebuilds it for ComfyUI's Wan tokenizer; None when the file has none."""
    from gguf import GGUFReader
    from sentencepiece import sentencepiece_model_pb2 as spm

    reader = GGUFReader(str(path))
    if _value(reader, "tokenizer.ggml.model") != "t5":
        return None
    model = spm.ModelProto()
    pieces = zip(_values(reader, "tokenizer.ggml.tokens"), _values(reader, "tokenizer.ggml.scores"),
                 _values(reader, "tokenizer.ggml.token_type"), strict=True)
    for piece, score, kind in pieces:
        model.pieces.add(piece=piece, score=float(score), type=int(kind))  # (gguf's token types are spm's)
    model.trainer_spec.model_type = spm.TrainerSpec.UNIGRAM
    model.trainer_spec.bos_id = -1
    for key, field in (("eos_token_id", "eos_id"), ("padding_token_id", "pad_id"), ("unknown_token_id", "unk_id")):
        if (value := _value(reader, f"tokenizer.ggml.{key}")) is not None:
            setattr(model.trainer_spec, field, int(value))
    spec = model.normalizer_spec
    spec.add_dummy_prefix = bool(_value(reader, "tokenizer.ggml.add_space_prefix", True))
    spec.remove_extra_whitespaces = bool(_value(reader, "tokenizer.ggml.remove_extra_whitespaces", True))
    spec.escape_whitespaces = True
    charsmap = reader.get_field("tokenizer.ggml.precompiled_charsmap")
    spec.precompiled_charsmap = bytes(_values(reader, "tokenizer.ggml.precompiled_charsmap")) if charsmap else b""
    return model.SerializeToString()


def _values(reader: Any, key: str) -> list[Any]:
    """The items of a GGUF array field, strings decoded."""
    field = reader.get_field(key)
    text = field.types[-1].name == "STRING"
    return [bytes(field.parts[i]).decode("utf-8") if text else field.parts[i].item() for i in field.data]


def _value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        return default
    value = field.parts[field.data[-1]]
    return bytes(value).decode("utf-8") if field.types[0].name == "STRING" else value.item()

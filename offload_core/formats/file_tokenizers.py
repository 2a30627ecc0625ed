"""Tokenizers that ComfyUI's text-encoder files carry, which are what ComfyUI's own tokenizers read: a
sentencepiece model (``spiece_model``: Comfy-Org's UMT5 and Gemma 3 files; a T5 GGUF file's tokenizer
metadata) built by transformers' converter into the config folder's class, or Mistral's tekken
vocabulary (``tekken_model``: Comfy-Org's Mistral Small files for FLUX.2 [dev]) built by transformers'
tekken converter, with Mistral's prompt format as its chat template.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ..log import get_logger
from .inspect import SingleFileError, inspect_safetensors

log = get_logger("single_file")

SPIECE = "spiece_model"  # ComfyUI's name for a sentencepiece model a text-encoder file carries
TEKKEN = "tekken_model"  # ComfyUI's name for a Mistral tekken vocabulary (tekken.json) a file carries
FILE_TOKENIZER_OPTIONS = {  # as the released tokenizers are: Wan's UMT5, LTX-2's Gemma 3 (which adds <bos>)
    "T5TokenizerFast": dict(extra_ids=0, model_max_length=512),
    "GemmaTokenizer": dict(add_bos_token=True), "GemmaTokenizerFast": dict(add_bos_token=True),
}
# Mistral's v7 prompt format (mistral-common's; ComfyUI's FLUX.2 prompt template is this form) for a
# conversation of system and user turns whose content is text or a list of text parts; padded on the
# left, as Mistral's processor and ComfyUI's Mistral tokenizer pad.
MISTRAL_CHAT = ("{{ bos_token }}{% for m in messages %}{% set c = m['content'] if m['content'] is string else "
                "m['content'] | map(attribute='text') | join('') %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ c }}"
                "[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[INST]{{ c }}[/INST]{% endif %}{% endfor %}")


def tokenizer_from_file(path: Path, cls_name: str, what: str) -> Any:
    """The tokenizer text-encoder file ``path`` carries: from its sentencepiece model as ``cls_name``
    (T5TokenizerFast for Wan's UMT5, GemmaTokenizer for LTX-2's Gemma 3; a T5 GGUF file's tokenizer
    metadata, `gguf_text_encoder.gguf_spiece`), or from its tekken vocabulary; ``what`` names the
    config folder that lacks one, for the error."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        from .gguf_text_encoder import gguf_spiece

        entries = {SPIECE: gguf_spiece(path)}
    else:
        entries = _entries(path)
    if entries.get(TEKKEN) is not None:
        return _tekken_tokenizer(path, entries[TEKKEN])
    model = entries.get(SPIECE)
    if model is None:
        raise SingleFileError(f"{what} has no tokenizer and {path.name} carries none (no {SPIECE} or {TEKKEN} "
                              "entry, or in a GGUF file no T5 tokenizer metadata): pick a text-encoder file that "
                              "carries it (Comfy-Org's umt5_xxl_fp8_e4m3fn_scaled does) or a diffusers config folder "
                              "with a tokenizer")
    return _spiece_tokenizer(path, model, cls_name, what)


def _spiece_tokenizer(path: Path, model: bytes, cls_name: str, what: str) -> Any:
    import transformers

    cls = getattr(transformers, cls_name, None)
    if not isinstance(cls, type):
        raise SingleFileError(f"{what}: tokenizer class {cls_name!r} is not in this transformers version")
    with tempfile.TemporaryDirectory(prefix="offload-tokenizer-") as tmp:
        (Path(tmp) / cls.vocab_files_names.get("vocab_file", "tokenizer.model")).write_bytes(model)
        try:
            tokenizer = cls.from_pretrained(tmp, **FILE_TOKENIZER_OPTIONS.get(cls_name, {}))
        except Exception as exc:  # no sentencepiece / protobuf, or a damaged model
            raise SingleFileError(f"the tokenizer {path.name} carries could not be read ({type(exc).__name__}: "
                                  f"{exc}); the pack needs the sentencepiece and protobuf packages") from exc
    log.info("%s: tokenizer read from its sentencepiece model (%d pieces)", path.name, len(tokenizer))
    return tokenizer


def _tekken_tokenizer(path: Path, vocabulary: bytes) -> Any:
    from transformers.integrations.mistral import convert_tekken_tokenizer

    with tempfile.TemporaryDirectory(prefix="offload-tokenizer-") as tmp:
        (Path(tmp) / "tekken.json").write_bytes(vocabulary)
        try:
            tokenizer = convert_tekken_tokenizer(str(Path(tmp) / "tekken.json"), chat_template=MISTRAL_CHAT)
        except Exception as exc:  # a damaged vocabulary
            raise SingleFileError(f"the tekken vocabulary {path.name} carries could not be read "
                                  f"({type(exc).__name__}: {exc})") from exc
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"  # (saved with it)
    log.info("%s: tokenizer read from its tekken vocabulary (%d tokens)", path.name, len(tokenizer))
    return tokenizer


def _entries(path: Path) -> dict[str, bytes]:
    """A safetensors file's tokenizer entries (uint8 tensors) by ComfyUI's name (`SPIECE`, `TEKKEN`)."""
    keys = {k.rsplit(".", 1)[-1]: k for k in inspect_safetensors(path).tokenizers}
    wanted = {name: keys[name] for name in (SPIECE, TEKKEN) if name in keys}
    if not wanted:
        return {}
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {name: f.get_tensor(key).numpy().tobytes() for name, key in wanted.items()}

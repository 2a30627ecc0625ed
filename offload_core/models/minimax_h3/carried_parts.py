"""The tokenizer and processor of a MiniMax-H3 config folder the pack carries, which holds neither
weights nor tokenizer files.

Why: ComfyUI's own H3 tokenizer is transformers' Qwen2 tokenizer read from the folder ComfyUI ships
(``comfy/text_encoders/qwen25_tokenizer``, named by the carried folder's ``tokenizers.json``), and
Qwen3-VL's processor is that tokenizer with the image and video processors the carried folder's
``processor`` configs describe. Built here, handed to the pipeline before it loads its components.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...formats.carried import processor_around, shipped_tokenizer

TOKENIZER_CLASS = "Qwen2TokenizerFast"  # what diffusers' H3 blocks expect


def tokenizer_and_processor(folder: Path, comfy_tokenizers: Path | None) -> dict[str, Any]:
    """``tokenizer`` and ``processor`` for the carried H3 folder ``folder``, the tokenizer from
    ``comfy_tokenizers`` (ComfyUI's ``comfy`` package folder)."""
    tokenizer = shipped_tokenizer(folder, "tokenizer", TOKENIZER_CLASS, comfy_tokenizers)
    return {"tokenizer": tokenizer, "processor": processor_around(Path(folder) / "processor", "Qwen3VLProcessor", tokenizer)}

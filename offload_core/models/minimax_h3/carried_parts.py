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

from ...formats.carried import shipped_tokenizer
from ...formats.inspect import SingleFileError
from ...log import get_logger

log = get_logger("loaders")
TOKENIZER_CLASS = "Qwen2TokenizerFast"  # what diffusers' H3 blocks expect


def tokenizer_and_processor(folder: Path, comfy_tokenizers: Path | None) -> dict[str, Any]:
    """``tokenizer`` and ``processor`` for the carried H3 folder ``folder``, the tokenizer from
    ``comfy_tokenizers`` (ComfyUI's ``comfy`` package folder)."""
    from transformers import AutoImageProcessor, AutoVideoProcessor, Qwen3VLProcessor

    tokenizer = shipped_tokenizer(folder, "tokenizer", TOKENIZER_CLASS, comfy_tokenizers)
    configs = Path(folder) / "processor"
    try:
        processor = Qwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(str(configs)),
                                     video_processor=AutoVideoProcessor.from_pretrained(str(configs)),
                                     tokenizer=tokenizer)
    except Exception as exc:  # a damaged carried folder: name it
        raise SingleFileError(f"{configs}: the image / video processor configs could not be read "
                              f"({type(exc).__name__}: {exc})") from exc
    log.info("%s: tokenizer and processor around ComfyUI's tokenizer (%d tokens)", Path(folder).name, len(tokenizer))
    return {"tokenizer": tokenizer, "processor": processor}

"""The carried folders whose prompts are read with Qwen3's chat template (Z-Image Turbo's, thinking
on; FLUX.2 [klein]'s, thinking off): their tokenizer, ComfyUI's ``qwen25_tokenizer`` read from the
running ComfyUI's own folder with the template the carried ``tokenizers.json`` gives, and the
pipeline's chat call give the ids of ComfyUI's own tokenizer for that model (its prompt template, no
system prompt), before its padding."""

from __future__ import annotations

import importlib

import pytest
from comfyhost import harness

pytest_plugins = ["comfyhost.fixtures"]
PAD = 151643  # <|endoftext|>: ComfyUI pads these prompts to 512 tokens, as the pipelines do
CASES = {  # carried folder -> (ComfyUI's module and tokenizer class, its token key, the pipeline's enable_thinking)
    "Z-Image-Turbo": ("comfy.text_encoders.z_image", "ZImageTokenizer", "qwen3_4b", True),
    "FLUX.2-klein-4B": ("comfy.text_encoders.flux", "KleinTokenizer", "qwen3_4b", False),
}


@pytest.mark.parametrize("folder", list(CASES))
def test_the_carried_tokenizer_reads_prompts_as_comfyuis_own(folder: str, comfy: harness.ComfyHost) -> None:
    module, cls, key, thinking = CASES[folder]
    try:
        theirs = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError):
        pytest.skip(f"this ComfyUI tree has no {cls}")
    carried = comfy.pack_submodule("offload_core.formats.carried")
    package = comfy.pack_submodule("nodes.model_files").comfy_package()
    ours = carried.shipped_tokenizer(carried.by_name(folder), "tokenizer", "Qwen2Tokenizer", package)
    for prompt in ("a red fox in the snow", "Ünïcødé — 東京の夜, neon signs", "two cats, one dog"):
        text = ours.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                        add_generation_prompt=True, enable_thinking=thinking)
        ids = [token[0] for token in theirs().tokenize_with_weights(prompt)[key][0]]
        mine = ours(text)["input_ids"]
        assert mine == ids[:len(mine)] and set(ids[len(mine):]) <= {PAD}, (text, ids)

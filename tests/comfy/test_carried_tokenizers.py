"""The carried folders whose prompts are read with Qwen3's chat template (Z-Image Turbo's, thinking
on; FLUX.2 [klein]'s, thinking off): their tokenizer, ComfyUI's ``qwen25_tokenizer`` read from the
running ComfyUI's own folder with the template the carried ``tokenizers.json`` gives, and the
pipeline's chat call give the ids of ComfyUI's own tokenizer for that model (its prompt template, no
system prompt), before its padding; FLUX.2 [dev]'s, read from the tekken vocabulary a Mistral
text-encoder file carries, gives the ids of ComfyUI's FLUX.2 tokenizer reading that vocabulary."""

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


def test_a_mistral_files_tekken_vocabulary_reads_prompts_as_comfyuis_flux2_tokenizer(comfy: harness.ComfyHost,
                                                                                     tmp_path) -> None:
    """FLUX.2 [dev]'s tokenizer, read by the pack from the tekken vocabulary a Mistral text-encoder
    file carries, with Flux2Pipeline's system and user turns, gives the ids of ComfyUI's own FLUX.2
    tokenizer reading the same vocabulary (its prompt template): <s>, the system prompt, the prompt."""
    import torch
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    from fixtures.tiny_tok import tiny_tekken
    from safetensors.torch import save_file

    try:
        from comfy.text_encoders.flux import Flux2Tokenizer
    except ImportError:
        pytest.skip("this ComfyUI tree has no FLUX.2 text encoder")
    vocabulary = torch.frombuffer(bytearray(tiny_tekken()), dtype=torch.uint8)
    path = tmp_path / "mistral_tiny.safetensors"
    save_file({"model.norm.weight": torch.ones(8), "tekken_model": vocabulary}, str(path))
    ours = comfy.pack_submodule("offload_core.formats.file_tokenizers").tokenizer_from_file(
        path, "PreTrainedTokenizerFast", "the test")
    try:
        theirs = Flux2Tokenizer(tokenizer_data={"tekken_model": vocabulary})
    except TypeError as exc:  # (v0.3.75 calls an older transformers' MistralConverter)
        pytest.skip(f"this ComfyUI tree's FLUX.2 tokenizer does not build with this transformers: {exc}")
    for prompt in ("a red fox in the snow", "Ünïcødé — 東京の夜, neon signs", "two cats, one dog"):
        mine = ours.apply_chat_template(format_input(prompts=[prompt]), tokenize=True, return_dict=True)["input_ids"][0]
        assert mine == [token[0] for token in theirs.tokenize_with_weights(prompt)["mistral3_24b"][0]]

"""Write the configs the pack carries (``offload_core/formats/carried_configs/``): configs-only
copies of the Wan-AI, FLUX.1, FLUX.2, LTX-2, Z-Image Turbo, Qwen-Image and Qwen-Image-Edit diffusers folders and of
MiniMax-H3's modular one, so a single-file user needs no diffusers folder.

The released values, each with its source, are in ``released_configs.py``. Each file is saved by its
real class (models built on the meta device), so it is what that class's loader reads. No tokenizer:
Wan's, LTX-2's and FLUX.2 [dev]'s come from the text-encoder file; FLUX.1's, FLUX.2 [klein]'s,
Z-Image's, Qwen-Image's and H3's from the folders ComfyUI ships them in (``tokenizers.json``). Run
after a diffusers upgrade that changes a config:

    .venv/bin/python tools/write_carried_configs.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import diffusers
import transformers
from accelerate import init_empty_weights

OUT = Path(__file__).resolve().parent.parent / "offload_core" / "formats" / "carried_configs"

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run as a file, or loaded by the tests)
from released_configs import (  # noqa: E402  (tools/ is the script's folder)
    CLIP_L,
    CLIP_PROCESSOR,
    CLIP_VIT_H,
    FLUX,
    FLUX2_DEV_TRANSFORMER,
    FLUX2_KLEIN,
    FLUX2_KLEIN_SIZES,
    FLUX2_KLEIN_TRANSFORMER,
    FLUX_SCHEDULER,
    FLUX_TOKENIZERS,
    FLUX_VAE,
    GEMMA3_12B_TEXT,
    GEMMA3_TOKENS,
    GEMMA3_VISION,
    H3_COMPONENTS,
    H3_TOKENIZERS,
    H3_VAE_STATS,
    LTX2,
    LTX2_CONNECTORS,
    LTX2_SCHEDULER,
    LTX2_TRANSFORMER,
    LTX2_VAE,
    MISTRAL_SMALL_24B_TEXT,
    QWEN3_4B,
    QWEN3_VL_32B_TEXT,
    QWEN3_VL_32B_VISION,
    QWEN3_VL_PIXELS,
    QWEN3_VL_TOKENS,
    QWEN25_VL_7B_TEXT,
    QWEN25_VL_7B_VISION,
    QWEN25_VL_PIXELS,
    QWEN_IMAGE_EDIT,
    QWEN_IMAGE_SCHEDULER,
    QWEN_IMAGE_TOKENIZERS,
    SIZES,
    T5_XXL,
    TRANSFORMER,
    UMT5_XXL,
    VARIANTS,
    Z_IMAGE_TOKENIZERS,
    Z_IMAGE_TRANSFORMER,
    Variant,
)


def write_variant(out: Path, v: Variant) -> None:
    image = {"image_dim": 1280, "added_kv_proj_dim": 5120} if v.image_encoder else {}
    transformer = {**TRANSFORMER, **SIZES[v.size], "in_channels": v.in_channels, "out_channels": v.out_channels,
                   **image}
    with init_empty_weights():
        for name in ("transformer", "transformer_2") if v.two_experts else ("transformer",):
            diffusers.WanTransformer3DModel.from_config(transformer).save_config(out / name)
        diffusers.AutoencoderKLWan.from_config(v.vae).save_config(out / "vae")
    diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                      num_train_timesteps=1000, flow_shift=v.flow_shift).save_config(out / "scheduler")
    umt5 = transformers.UMT5Config(**UMT5_XXL)
    umt5.architectures = ["UMT5EncoderModel"]
    umt5.save_pretrained(out / "text_encoder")
    index = {"_class_name": v.pipeline, "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
             "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
             "transformer_2": ["diffusers", "WanTransformer3DModel"] if v.two_experts else [None, None],
             "vae": ["diffusers", "AutoencoderKLWan"], **v.flags}
    if v.pipeline == "WanImageToVideoPipeline":
        index["image_encoder"], index["image_processor"] = [None, None], [None, None]
    if v.image_encoder:
        clip = transformers.CLIPVisionConfig(**CLIP_VIT_H)
        clip.architectures = ["CLIPVisionModelWithProjection"]
        clip.save_pretrained(out / "image_encoder")
        transformers.CLIPImageProcessor(**CLIP_PROCESSOR).save_pretrained(out / "image_processor")
        index["image_encoder"] = ["transformers", "CLIPVisionModelWithProjection"]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    (out / "model_index.json").write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")


def write_flux(out: Path, guidance_embeds: bool, shift: float, use_dynamic_shifting: bool,
               pipeline: str = "FluxPipeline") -> None:
    with init_empty_weights():
        diffusers.FluxTransformer2DModel.from_config({"guidance_embeds": guidance_embeds}).save_config(out / "transformer")
        diffusers.AutoencoderKL.from_config(FLUX_VAE).save_config(out / "vae")
    diffusers.FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER, shift=shift, use_dynamic_shifting=use_dynamic_shifting
                                              ).save_config(out / "scheduler")
    for name, config, cls in (("text_encoder", transformers.CLIPTextConfig(**CLIP_L), "CLIPTextModel"),
                              ("text_encoder_2", transformers.T5Config(**T5_XXL), "T5EncoderModel")):
        config.architectures = [cls]
        config.save_pretrained(out / name)
    index = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__,
             "feature_extractor": [None, None], "image_encoder": [None, None],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
             "text_encoder_2": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
             "tokenizer_2": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "FluxTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKL"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "tokenizers.json").write_text(json.dumps(FLUX_TOKENIZERS, indent=2) + "\n")


def write_ltx2(out: Path, use_dynamic_shifting: bool, shift_terminal: float | None) -> None:
    """LTX-2 19B: dev and distilled share every model (they differ in the scheduler only); the
    tokenizer comes from the Gemma file (its ``spiece_model``)."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    with init_empty_weights():
        for name, cls, config in (("transformer", diffusers.LTX2VideoTransformer3DModel, LTX2_TRANSFORMER),
                                  ("connectors", LTX2TextConnectors, LTX2_CONNECTORS),
                                  ("vae", diffusers.AutoencoderKLLTX2Video, LTX2_VAE),
                                  ("audio_vae", diffusers.AutoencoderKLLTX2Audio, {}), ("vocoder", LTX2Vocoder, {})):
            cls.from_config(config).save_config(out / name)
    diffusers.FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER, use_dynamic_shifting=use_dynamic_shifting,
                                              shift_terminal=shift_terminal).save_config(out / "scheduler")
    gemma = transformers.Gemma3Config(text_config=GEMMA3_12B_TEXT, vision_config=GEMMA3_VISION, **GEMMA3_TOKENS)
    gemma.architectures = ["Gemma3ForConditionalGeneration"]
    gemma.save_pretrained(out / "text_encoder")
    index = {"_class_name": "LTX2Pipeline", "_diffusers_version": diffusers.__version__,
             "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"], "connectors": ["ltx2", "LTX2TextConnectors"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
             "tokenizer": ["transformers", "GemmaTokenizerFast"],
             "transformer": ["diffusers", "LTX2VideoTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLLTX2Video"],
             "vocoder": ["ltx2", "LTX2Vocoder"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_z_image(out: Path) -> None:
    """Z-Image Turbo: its transformer, Qwen3-4B as the text encoder (a ``Qwen3Model``: ComfyUI's
    ``qwen_3_4b`` file holds no head), the FLUX.1 VAE, a fixed shift of 3."""
    with init_empty_weights():
        diffusers.ZImageTransformer2DModel.from_config(Z_IMAGE_TRANSFORMER).save_config(out / "transformer")
        diffusers.AutoencoderKL.from_config(FLUX_VAE).save_config(out / "vae")
    diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False
                                              ).save_config(out / "scheduler")
    qwen3 = transformers.Qwen3Config(**QWEN3_4B)
    qwen3.architectures = ["Qwen3ForCausalLM"]
    qwen3.save_pretrained(out / "text_encoder")
    index = {"_class_name": "ZImagePipeline", "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers", "Qwen3Model"],
             "tokenizer": ["transformers", "Qwen2Tokenizer"], "transformer": ["diffusers", "ZImageTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKL"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "tokenizers.json").write_text(json.dumps(Z_IMAGE_TOKENIZERS, indent=2) + "\n")


def write_qwen_image(out: Path, pipeline: str = "QwenImagePipeline", zero_cond_t: bool = False) -> None:
    """Qwen-Image (text to image): its transformer and VAE (the classes' defaults), Qwen2.5-VL-7B as
    the text encoder (ComfyUI's ``qwen_2.5_vl_7b`` files: the language model, the vision tower and the
    head), the scheduler's dynamic shift. An edit ``pipeline`` adds the processor its vision tower
    reads the reference images through (image configs; the tokenizer is the pipeline's)."""
    with init_empty_weights():
        diffusers.QwenImageTransformer2DModel.from_config({"zero_cond_t": True} if zero_cond_t else {}
                                                          ).save_config(out / "transformer")
        diffusers.AutoencoderKLQwenImage.from_config({}).save_config(out / "vae")
    diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **QWEN_IMAGE_SCHEDULER).save_config(out / "scheduler")
    text = transformers.Qwen2_5_VLConfig(text_config=QWEN25_VL_7B_TEXT, vision_config=QWEN25_VL_7B_VISION,
                                         tie_word_embeddings=False, **QWEN3_VL_TOKENS)
    text.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    text.save_pretrained(out / "text_encoder")
    index = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
             "tokenizer": ["transformers", "Qwen2Tokenizer"], "transformer": ["diffusers", "QwenImageTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKLQwenImage"]}
    if pipeline != "QwenImagePipeline":
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
        pixels = dict(QWEN25_VL_PIXELS)
        transformers.Qwen2VLImageProcessor(**pixels).save_pretrained(out / "processor")
        transformers.Qwen2VLVideoProcessor(**pixels).save_pretrained(out / "processor")
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "tokenizers.json").write_text(json.dumps(QWEN_IMAGE_TOKENIZERS, indent=2) + "\n")


def write_flux2_klein(out: Path, size: str, text_encoder: dict, distilled: bool) -> None:
    """FLUX.2 [klein]: its transformer, a headless Qwen3 text encoder, distilled or base (`write_flux2`)."""
    qwen3 = transformers.Qwen3Config(**text_encoder)
    qwen3.architectures = ["Qwen3ForCausalLM"]
    write_flux2(out, {**FLUX2_KLEIN_TRANSFORMER, **FLUX2_KLEIN_SIZES[size]}, qwen3, "Qwen3Model", "Flux2KleinPipeline",
                "Qwen2Tokenizer", is_distilled=distilled)
    (out / "tokenizers.json").write_text(json.dumps(Z_IMAGE_TOKENIZERS, indent=2) + "\n")


def write_flux2_dev(out: Path) -> None:
    """FLUX.2 [dev]: its transformer, Mistral Small 3.1's language model as the text encoder (its
    tokenizer read from the text-encoder file) (`write_flux2`)."""
    mistral = transformers.MistralConfig(**MISTRAL_SMALL_24B_TEXT)
    mistral.architectures = ["MistralModel"]
    write_flux2(out, FLUX2_DEV_TRANSFORMER, mistral, "MistralModel", "Flux2Pipeline", "PreTrainedTokenizerFast")


def write_flux2(out: Path, transformer: dict, text: Any, text_class: str, pipeline: str, tokenizer: str,
                **fields: Any) -> None:
    """A FLUX.2 folder: the transformer of config ``transformer``, the FLUX.2 VAE, FLUX.1-dev's
    scheduler (the pipeline computes its own shift), the text encoder of config ``text``."""
    with init_empty_weights():
        diffusers.Flux2Transformer2DModel.from_config(transformer).save_config(out / "transformer")
        diffusers.AutoencoderKLFlux2.from_config({}).save_config(out / "vae")
    diffusers.FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER, shift=3.0, use_dynamic_shifting=True
                                              ).save_config(out / "scheduler")
    text.save_pretrained(out / "text_encoder")
    index = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__, **fields,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers", text_class],
             "tokenizer": ["transformers", tokenizer], "transformer": ["diffusers", "Flux2Transformer2DModel"],
             "vae": ["diffusers", "AutoencoderKLFlux2"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_h3(out: Path) -> None:
    """MiniMax-H3's modular folder: every component's config, no weights; the index points nowhere
    (``null``), so only the schedulers resolve from the folder and the loader supplies the rest."""
    with init_empty_weights():
        for name in ("transformer", "transformer_ref"):
            diffusers.MiniMaxH3Transformer3DModel.from_config({}).save_config(out / name)
        diffusers.AutoencoderKLMiniMaxH3.from_config(H3_VAE_STATS).save_config(out / "vae")
        diffusers.AutoencoderKLMiniMaxH3Audio.from_config({}).save_config(out / "audio_vae")
    for name, shift in (("scheduler", 12.0), ("audio_scheduler", 3.0)):
        diffusers.MiniMaxH3Scheduler(shift=shift).save_config(out / name)
    text = transformers.Qwen3VLConfig(text_config=QWEN3_VL_32B_TEXT, vision_config=QWEN3_VL_32B_VISION,
                                      tie_word_embeddings=False, **QWEN3_VL_TOKENS)
    text.architectures = ["Qwen3VLForConditionalGeneration"]
    text.save_pretrained(out / "text_encoder")
    transformers.Qwen2VLImageProcessor(**QWEN3_VL_PIXELS, size={"shortest_edge": 256 * 256, "longest_edge": 4096 * 4096}
                                       ).save_pretrained(out / "processor")
    transformers.Qwen3VLVideoProcessor(**QWEN3_VL_PIXELS, size={"shortest_edge": 64 * 64, "longest_edge": 24 * 1024 * 1024}
                                       ).save_pretrained(out / "processor")
    index: dict = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": diffusers.__version__,
                   "_blocks_class_name": "MiniMaxH3Blocks"}
    for name, (library, cls) in H3_COMPONENTS.items():
        index[name] = [library, cls, {"pretrained_model_name_or_path": None, "revision": None, "subfolder": name,
                                      "type_hint": [library, cls], "variant": None}]
    (out / "modular_model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "tokenizers.json").write_text(json.dumps(H3_TOKENIZERS, indent=2) + "\n")


def main(root: Path = OUT) -> None:
    if root.exists():
        shutil.rmtree(root)
    for name, variant in VARIANTS.items():
        write_variant(root / name, variant)
        print(f"wrote {root / name}")
    for name, flux in FLUX.items():
        write_flux(root / name, **flux)
        print(f"wrote {root / name}")
    for name, ltx2 in LTX2.items():
        write_ltx2(root / name, **ltx2)
        print(f"wrote {root / name}")
    write_z_image(root / "Z-Image-Turbo")
    print(f"wrote {root / 'Z-Image-Turbo'}")
    write_qwen_image(root / "Qwen-Image")
    print(f"wrote {root / 'Qwen-Image'}")
    for name, (pipeline, zero_cond_t) in QWEN_IMAGE_EDIT.items():
        write_qwen_image(root / name, pipeline, zero_cond_t)
        print(f"wrote {root / name}")
    for name, klein in FLUX2_KLEIN.items():
        write_flux2_klein(root / name, *klein)
        print(f"wrote {root / name}")
    write_flux2_dev(root / "FLUX.2-dev")
    print(f"wrote {root / 'FLUX.2-dev'}")
    write_h3(root / "MiniMax-H3")
    print(f"wrote {root / 'MiniMax-H3'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)

"""The single-file templates' ComfyUI files: what each widget of "Load diffusion model file
(diffusers)" names, where the file comes from, and the Note that tells users so.

Why apart from ``offload_examples``: a single-file template picks what a folder template does
not, the configs the pack carries (config ``auto``: nothing to download) and files in ComfyUI's own
model folders (the denoiser in ``diffusion_models`` or, LTX-2's all-in-one file, ``checkpoints``,
the text encoders in ``text_encoders``, the VAE in ``vae``: the files ComfyUI's own Wan, Flux and
LTX-2 workflows use). The Note names each file with
its download address; the tests stand in the tiny file of the same role (``ComfyFile.tiny``) for
each. Imports nothing from ComfyUI or from the rest of tools/.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

SINGLE_FILE_LOADER = "DiffusersOffloadLoadDiffusionModelFile"
COMFY_MODELS = "ComfyUI/models"
AUTO_CONFIG = "auto: the configs the pack carries"  # the loader's option: the configs the pack carries


@dataclass(frozen=True)
class ComfyFile:
    """One file a single-file template picks: the loader input naming it, ComfyUI's model folder
    it goes in, its Hugging Face repository and path there, and the tiny stand-in the tests use
    (a format of ``comfy_files.comfy_wan``, a GGUF qtype, or the component's own name)."""

    input: str
    folder: str
    repo: str
    path: str
    tiny: str

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    @property
    def url(self) -> str:
        return f"https://huggingface.co/{self.repo}/resolve/main/{self.path}"


COMFY_WAN21 = "Comfy-Org/Wan_2.1_ComfyUI_repackaged"
WAN_TEXT_ENCODER = ComfyFile("text_encoder", "text_encoders", COMFY_WAN21,
                             "split_files/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors", "text_encoder")
WAN_VAE = ComfyFile("vae", "vae", COMFY_WAN21, "split_files/vae/wan_2.1_vae.safetensors", "vae")
WAN_14B_FP8_SCALED = ComfyFile("denoiser", "diffusion_models", COMFY_WAN21,
                               "split_files/diffusion_models/wan2.1_t2v_14B_fp8_scaled.safetensors", "fp8_scaled")
WAN_14B_GGUF_Q8_0 = ComfyFile("denoiser", "diffusion_models", "city96/Wan2.1-T2V-14B-gguf",
                              "wan2.1-t2v-14b-Q8_0.gguf", "Q8_0")
COMFY_WAN22 = "Comfy-Org/Wan_2.2_ComfyUI_Repackaged"
FLUX_SCHNELL_REPO, FLUX_TEXT_ENCODERS = "black-forest-labs/FLUX.1-schnell", "comfyanonymous/flux_text_encoders"
FLUX_SCHNELL = ComfyFile("denoiser", "diffusion_models", FLUX_SCHNELL_REPO, "flux1-schnell.safetensors", "bf16")
FLUX_CLIP_L = ComfyFile("text_encoder", "text_encoders", FLUX_TEXT_ENCODERS, "clip_l.safetensors", "text_encoder")
FLUX_T5XXL_FP8 = ComfyFile("text_encoder_2", "text_encoders", FLUX_TEXT_ENCODERS, "t5xxl_fp8_e4m3fn.safetensors",
                           "text_encoder_2")
FLUX_AE = ComfyFile("vae", "vae", FLUX_SCHNELL_REPO, "ae.safetensors", "vae")


Z_IMAGE_REPO, COMFY_Z_IMAGE = "Tongyi-MAI/Z-Image-Turbo", "Comfy-Org/z_image_turbo"
Z_IMAGE_TURBO = ComfyFile("denoiser", "diffusion_models", COMFY_Z_IMAGE,
                          "split_files/diffusion_models/z_image_turbo_bf16.safetensors", "bf16")
Z_IMAGE_QWEN3 = ComfyFile("text_encoder", "text_encoders", COMFY_Z_IMAGE, "split_files/text_encoders/qwen_3_4b.safetensors",
                          "text_encoder")
Z_IMAGE_AE = ComfyFile("vae", "vae", COMFY_Z_IMAGE, "split_files/vae/ae.safetensors", "vae")
QWEN_IMAGE_REPO, COMFY_QWEN_IMAGE = "Qwen/Qwen-Image", "Comfy-Org/Qwen-Image_ComfyUI"
QWEN_IMAGE_FP8 = ComfyFile("denoiser", "diffusion_models", COMFY_QWEN_IMAGE,
                           "split_files/diffusion_models/qwen_image_fp8_e4m3fn.safetensors", "fp8")
QWEN_IMAGE_TEXT_ENCODER = ComfyFile("text_encoder", "text_encoders", COMFY_QWEN_IMAGE,
                                    "split_files/text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors", "text_encoder")
QWEN_IMAGE_VAE = ComfyFile("vae", "vae", COMFY_QWEN_IMAGE, "split_files/vae/qwen_image_vae.safetensors", "vae")
QWEN_IMAGE_EDIT_REPO, COMFY_QWEN_IMAGE_EDIT = "Qwen/Qwen-Image-Edit-2509", "Comfy-Org/Qwen-Image-Edit_ComfyUI"
QWEN_IMAGE_EDIT_FP8 = ComfyFile("denoiser", "diffusion_models", COMFY_QWEN_IMAGE_EDIT,
                                "split_files/diffusion_models/qwen_image_edit_2509_fp8_e4m3fn.safetensors", "fp8")
FLUX2_KLEIN_REPO = "black-forest-labs/FLUX.2-klein-4B"
FLUX2_KLEIN_FP8 = ComfyFile("denoiser", "diffusion_models", "black-forest-labs/FLUX.2-klein-4b-fp8",
                            "flux-2-klein-4b-fp8.safetensors", "fp8_scaled")
FLUX2_VAE = ComfyFile("vae", "vae", "Comfy-Org/flux2-dev", "split_files/vae/flux2-vae.safetensors", "vae")
FLUX2_DEV_REPO, COMFY_FLUX2_DEV = "black-forest-labs/FLUX.2-dev", "Comfy-Org/flux2-dev"
FLUX2_DEV_FP8 = ComfyFile("denoiser", "diffusion_models", COMFY_FLUX2_DEV,
                          "split_files/diffusion_models/flux2_dev_fp8mixed.safetensors", "fp8_scaled")
FLUX2_DEV_MISTRAL = ComfyFile("text_encoder", "text_encoders", COMFY_FLUX2_DEV,
                              "split_files/text_encoders/mistral_3_small_flux2_fp8.safetensors", "text_encoder")
SHIPPED_TOKENIZERS = {"FluxPipeline": "the tokenizers are ComfyUI's own.",  # the carried ones that ComfyUI ships
                      "ZImagePipeline": "the tokenizer is ComfyUI's own (its Qwen folder).",
                      "QwenImagePipeline": "the tokenizer is ComfyUI's own (its Qwen folder).",
                      "QwenImageEditPlusPipeline": "the tokenizer is ComfyUI's own (its Qwen folder).",
                      "Flux2KleinPipeline": "the tokenizer is ComfyUI's own (its Qwen folder)."}

LTX2_REPO = "Lightricks/LTX-2"  # the checkpoint and Gemma file ComfyUI's own LTX-2 templates name
LTX2_FP8 = ComfyFile("denoiser", "checkpoints", LTX2_REPO, "ltx-2-19b-dev-fp8.safetensors", "checkpoint")
LTX2_GEMMA_FP4 = ComfyFile("text_encoder", "text_encoders", "Comfy-Org/ltx-2",
                           "split_files/text_encoders/gemma_3_12B_it_fp4_mixed.safetensors", "text_encoder")


def wan22_expert(task: str, noise: str) -> ComfyFile:
    """Comfy-Org's fp8_scaled Wan 2.2 A14B expert (``task`` t2v / i2v, ``noise`` high / low): the
    high-noise one runs the first steps (denoiser, transformer), the low-noise one the rest."""
    return ComfyFile("denoiser" if noise == "high" else "denoiser_2", "diffusion_models", COMFY_WAN22,
                     f"split_files/diffusion_models/wan2.2_{task}_{noise}_noise_14B_fp8_scaled.safetensors",
                     "fp8_scaled")


WAN22_HIGH_FP8_SCALED, WAN22_LOW_FP8_SCALED = wan22_expert("t2v", "high"), wan22_expert("t2v", "low")
WAN22_I2V_HIGH_FP8_SCALED, WAN22_I2V_LOW_FP8_SCALED = wan22_expert("i2v", "high"), wan22_expert("i2v", "low")


def note_text(example: Any) -> str:
    """The Note of a single-file template (``example`` an ``offload_examples.Example`` with
    ``files``, config ``auto``): the pipeline whose configs the pack carries, then each file, its
    folder and address."""
    lines = [
        example.title,
        "",
        f"Runs ComfyUI model files in the diffusers pipeline of {example.repo}",
        f"(https://huggingface.co/{example.repo}), whose configs the pack carries: config 'auto' picks them",
        "by the denoiser file, and " + SHIPPED_TOKENIZERS.get(example.pipeline, "the tokenizer is read from the "
                                                                 "text-encoder file.") + " Nothing else to download.",
        "",
        *(["The model files, each in the folder named (the ones ComfyUI's own templates for this model use):"]
          if any(file.folder == "checkpoints" for file in example.files) else
          ["The model files, each in the folder named (the text encoders and VAE are the ones ComfyUI's own",
           "workflows for this model use):"]),
    ]
    for file in example.files:
        lines += [f"{COMFY_MODELS}/{file.folder}/{file.name}", f"  {file.url}"]
    if any(file.input == "denoiser_2" for file in example.files):
        lines += ["", "The high-noise expert goes in denoiser (it runs the first steps), the low-noise one in denoiser_2."]
    if any(file.folder == "checkpoints" for file in example.files):
        lines += ["", "The checkpoint holds the VAEs, vocoder and text connectors too: the loader reads them from it."]
    if any(file.name.endswith(".gguf") for file in example.files):
        lines += ["", "The loader lists .gguf files in diffusion_models (and unet) itself: ComfyUI-GGUF is not needed."]
    lines += [
        "",
        "Folders elsewhere work too when extra_model_paths.yaml adds them. Refresh the page (R) and pick",
        "the files in Load diffusion model file (diffusers).",
    ]
    return "\n".join(lines)

"""The image transformers the bench runs beside Wan's (``wan_bench.py --model``): FLUX.1-dev's geometry,
and Z-Image Turbo's, Qwen-Image's, FLUX.2 [dev]'s and [klein] 9B's from the configs the pack carries,
each with one pipeline step's inputs as its pipeline makes them, at 1024x1024 (``tiny``: a small width
and depth for CPU dry runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .models import cast_like_from_pretrained

# -- FLUX.1-dev geometry: two towers --------------------------------------------------------------
# 19 dual-stream blocks of 0.633 GiB and 38 single-stream ones of 0.264 GiB, 11.9 B parameters,
# 22.17 GiB in bf16 (0.12 GiB outside the blocks).
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
# Width 128, 2 + 2 blocks (CPU smoke runs); the text width stays 4096 and the pooled one 768.
FLUX_TINY = dict(FLUX_DEV, num_layers=2, num_single_layers=2, num_attention_heads=2, attention_head_dim=64,
                 axes_dims_rope=(8, 28, 28))
FLUX_IMAGE = {"image": 1024}  # pixels a side: 1024x1024 -> 128x128 latents -> 4096 packed tokens
FLUX_TEXT = 512  # T5 tokens (FLUX.1-dev's max_sequence_length)


def build_flux(device: str | torch.device = "cuda", tiny: bool = False) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        m = FluxTransformer2DModel(**(FLUX_TINY if tiny else FLUX_DEV))
    return cast_like_from_pretrained(m, torch.bfloat16)


def flux_inputs(name: str, device: str | torch.device = "cuda", tiny: bool = False) -> tuple:
    """One FluxPipeline denoising call's transformer inputs at ``FLUX_IMAGE[name]`` pixels a side
    (128 with ``tiny``): packed latents (1, tokens, 64), T5 states (1, 512, 4096; 64 tokens tiny),
    CLIP pooled (1, 768), timestep 0.5 (the pipeline passes t / 1000), guidance 3.5, and the ids
    as ``FluxPipeline`` makes them (``_prepare_latent_image_ids``; zero text ids), in the dtype of
    the text states."""
    side = 128 if tiny else FLUX_IMAGE[name]
    grid = side // 16  # the pipeline's latent side 2 * (side // 16) over its 2x2 packing
    g = torch.Generator(device=device).manual_seed(1)
    dt = torch.bfloat16
    x = torch.randn((1, grid * grid, 64), generator=g, device=device, dtype=dt)
    enc = torch.randn((1, 64 if tiny else FLUX_TEXT, 4096), generator=g, device=device, dtype=dt)
    pooled = torch.randn((1, 768), generator=g, device=device, dtype=dt)
    img_ids = torch.zeros(grid, grid, 3)
    img_ids[..., 1] += torch.arange(grid)[:, None]
    img_ids[..., 2] += torch.arange(grid)[None, :]
    img_ids = img_ids.reshape(grid * grid, 3).to(device=device, dtype=dt)
    txt_ids = torch.zeros(enc.shape[1], 3, device=device, dtype=dt)
    t = torch.full((1,), 500.0, device=device).to(dt) / 1000
    guidance = torch.full((1,), 3.5, device=device, dtype=torch.float32)
    return x, enc, pooled, t, guidance, img_ids, txt_ids


def flux_forward(m, x, enc, pooled, t, guidance, img_ids, txt_ids) -> torch.Tensor:
    with torch.inference_mode():
        return m(hidden_states=x, timestep=t, guidance=guidance, pooled_projections=pooled, encoder_hidden_states=enc,
                 txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]


# Z-Image Turbo's transformer as the pack carries its config (6.15 B parameters; its refiners ride in the
# non-block part); tiny: width 128, 2 layers. A 1024x1024 image: 128x128 latents, 4096 tokens beside the caption.
Z_IMAGE_TINY = dict(dim=128, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=64,
                    axes_dims=[16, 24, 24])
Z_IMAGE_CAPTION = 128  # prompt tokens (the pipeline passes only the prompt's own, unpadded)


def build_zimage(device: str | torch.device = "cuda", tiny: bool = False) -> torch.nn.Module:
    from diffusers import ZImageTransformer2DModel
    from diffusers_offload.offload_core.formats.carried import by_name

    config = dict(ZImageTransformer2DModel.load_config(str(by_name("Z-Image-Turbo") / "transformer")))
    torch.manual_seed(0)
    with torch.device(device):
        m = ZImageTransformer2DModel.from_config({**config, **(Z_IMAGE_TINY if tiny else {})})
    return cast_like_from_pretrained(m, torch.bfloat16)


def zimage_inputs(name: str, device: str | torch.device = "cuda", tiny: bool = False) -> tuple:
    """One ZImagePipeline step's transformer inputs for a ``FLUX_IMAGE[name]`` image (128 px tiny):
    the latents as its list of (16, 1, h, w), timestep 0.5 (the pipeline's ``(1000 - t) / 1000``),
    the caption's hidden states as a list of (tokens, width)."""
    side = (128 if tiny else FLUX_IMAGE[name]) // 8
    g = torch.Generator(device=device).manual_seed(1)
    dt = torch.bfloat16
    x = torch.randn((16, 1, side, side), generator=g, device=device, dtype=dt)
    cap = torch.randn((16 if tiny else Z_IMAGE_CAPTION, 64 if tiny else 2560), generator=g, device=device, dtype=dt)
    return [x], torch.full((1,), 0.5, device=device, dtype=dt), [cap]


def zimage_forward(m, x, t, cap) -> torch.Tensor:
    with torch.inference_mode():
        return torch.stack(m(x, t, cap, return_dict=False)[0])


# Qwen-Image's transformer as the pack carries its config (60 dual-stream blocks of 0.634 GiB, 20.43 B
# parameters, 38.1 GiB in bf16); tiny: width 128, 2 blocks. 1024x1024: 64x64 packed tokens beside the prompt.
QWEN_IMAGE_TINY = dict(num_layers=2, num_attention_heads=2, attention_head_dim=64, axes_dims_rope=(16, 24, 24))
QWEN_IMAGE_PROMPT = 128  # prompt tokens after the template's 34 (the pipeline passes only the prompt's own)


def build_qwenimage(device: str | torch.device = "cuda", tiny: bool = False, layers: int | None = None,
                    name: str = "Qwen-Image") -> torch.nn.Module:
    """Qwen-Image's transformer, or the carried folder ``name``'s (``layers``: its first blocks only,
    at full width)."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers_offload.offload_core.formats.carried import by_name

    config = dict(QwenImageTransformer2DModel.load_config(str(by_name(name) / "transformer")))
    depth = {"num_layers": layers} if layers else {}
    torch.manual_seed(0)
    with torch.device(device):
        m = QwenImageTransformer2DModel.from_config({**config, **depth, **(QWEN_IMAGE_TINY if tiny else {})})
    return cast_like_from_pretrained(m, torch.bfloat16)


def qwenimage_inputs(name: str, device: str | torch.device = "cuda", tiny: bool = False) -> tuple:
    """One QwenImagePipeline step's transformer inputs for a ``FLUX_IMAGE[name]`` image (128 px tiny):
    packed latents (1, tokens, 64), the prompt's states (1, tokens, 3584) and mask, timestep 0.5
    (the pipeline passes t / 1000), the image's packed grid as ``img_shapes``."""
    grid = (128 if tiny else FLUX_IMAGE[name]) // 16
    g = torch.Generator(device=device).manual_seed(1)
    dt = torch.bfloat16
    x = torch.randn((1, grid * grid, 64), generator=g, device=device, dtype=dt)
    enc = torch.randn((1, 16 if tiny else QWEN_IMAGE_PROMPT, 3584), generator=g, device=device, dtype=dt)
    mask = torch.ones(enc.shape[:2], device=device, dtype=torch.long)
    return x, enc, mask, torch.full((1,), 0.5, device=device, dtype=dt), [[(1, grid, grid)]]


def qwenedit_inputs(name: str, device: str | torch.device = "cuda", tiny: bool = False) -> tuple:
    """One QwenImageEditPlusPipeline step's transformer inputs: `qwenimage_inputs`' latents, then one
    reference image's of the same size (its grid the second of ``img_shapes``), as the pipeline
    concatenates them."""
    x, enc, mask, t, shapes = qwenimage_inputs(name, device, tiny)
    reference = torch.randn(x.shape, generator=torch.Generator(device=device).manual_seed(2), device=device,
                            dtype=x.dtype)
    return torch.cat([x, reference], dim=1), enc, mask, t, [shapes[0] * 2]


def qwenimage_forward(m, x, enc, mask, t, img_shapes) -> torch.Tensor:
    with torch.inference_mode():
        return m(hidden_states=x, encoder_hidden_states=enc, encoder_hidden_states_mask=mask, timestep=t,
                 img_shapes=img_shapes, return_dict=False)[0]


# FLUX.2's transformers as the pack carries their configs: [dev] (8 dual- and 48 single-stream blocks, 32.2 B
# parameters, 60.0 GiB in bf16, its text states Mistral's three layers: width 15360) and [klein] 9B (8 + 24,
# 12288); tiny: width 128, 1 + 1 blocks. 1024x1024: 64x64 packed tokens of 128 channels, 512 text tokens.
FLUX2_TINY = dict(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=64,
                  axes_dims_rope=(16, 16, 16, 16))
FLUX2_TEXT = 512  # the pipelines' max_sequence_length: the prompt padded to it


def build_flux2(device: str | torch.device = "cuda", tiny: bool = False, name: str = "FLUX.2-dev",
                layers: int | None = None) -> torch.nn.Module:
    """A FLUX.2 transformer (``layers``: that many dual- and single-stream blocks, at full width)."""
    from diffusers import Flux2Transformer2DModel
    from diffusers_offload.offload_core.formats.carried import by_name

    config = dict(Flux2Transformer2DModel.load_config(str(by_name(name) / "transformer")))
    config.update({"num_layers": layers, "num_single_layers": layers} if layers else {})
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16: [dev] in fp32 (120 GiB) fits no card
    try:
        with torch.device(device):
            m = Flux2Transformer2DModel.from_config({**config, **(FLUX2_TINY if tiny else {})})
    finally:
        torch.set_default_dtype(default)
    return cast_like_from_pretrained(m, torch.bfloat16)


def flux2_inputs(name: str, device: str | torch.device = "cuda", tiny: bool = False, text_dim: int = 15360,
                 guidance: float | None = 4.0) -> tuple:
    """One Flux2Pipeline step's transformer inputs for a ``FLUX_IMAGE[name]`` image (128 px tiny): packed
    latents (1, tokens, 128), the text states (1, 512, ``text_dim``; 16 tokens tiny), timestep 0.5 (the
    pipeline passes t / 1000), ``guidance`` (None: a model without the embedding) and the 4-axis ids
    as ``_prepare_latent_ids`` / ``_prepare_text_ids`` make them."""
    grid = (128 if tiny else FLUX_IMAGE[name]) // 16
    g = torch.Generator(device=device).manual_seed(1)
    dt = torch.bfloat16
    x = torch.randn((1, grid * grid, 128), generator=g, device=device, dtype=dt)
    enc = torch.randn((1, 16 if tiny else FLUX2_TEXT, text_dim), generator=g, device=device, dtype=dt)
    zero = torch.arange(1)
    img_ids = torch.cartesian_prod(zero, torch.arange(grid), torch.arange(grid), zero)[None].to(device)
    txt_ids = torch.cartesian_prod(zero, zero, zero, torch.arange(enc.shape[1]))[None].to(device)
    g_in = None if guidance is None else torch.full((1,), guidance, device=device, dtype=torch.float32)
    return x, enc, torch.full((1,), 0.5, device=device, dtype=dt), g_in, img_ids, txt_ids


def klein_inputs(name: str, device: str | torch.device = "cuda", tiny: bool = False) -> tuple:
    return flux2_inputs(name, device, tiny, text_dim=12288, guidance=None)


def flux2_forward(m, x, enc, t, guidance, img_ids, txt_ids) -> torch.Tensor:
    with torch.inference_mode():
        return m(hidden_states=x, encoder_hidden_states=enc, timestep=t, guidance=guidance, img_ids=img_ids,
                 txt_ids=txt_ids, return_dict=False)[0]


@dataclass(frozen=True)
class ImageModel:
    """One ``--model``: its builder (device, tiny), inputs (workload, device, tiny) and forward."""

    build: Callable[..., torch.nn.Module]
    inputs: Callable[..., tuple]
    forward: Callable[..., Any]


IMAGE_MODELS = {"flux": ImageModel(build_flux, flux_inputs, flux_forward),
                "zimage": ImageModel(build_zimage, zimage_inputs, zimage_forward),
                "qwenimage": ImageModel(build_qwenimage, qwenimage_inputs, qwenimage_forward),
                "qwenedit": ImageModel(partial(build_qwenimage, name="Qwen-Image-Edit-2511"), qwenedit_inputs,
                                       qwenimage_forward),
                "flux2": ImageModel(build_flux2, flux2_inputs, flux2_forward),
                "klein9b": ImageModel(partial(build_flux2, name="FLUX.2-klein-9B"), klein_inputs, flux2_forward)}

"""Random-weight models at real geometries (Wan 2.1 14B, MiniMax-H3; the image transformers in
``image_models``), built the way the benches need them.

Every model is built on the bench device with seed 0 and cast as ``from_pretrained(dtype=bf16)``
casts a checkpoint (the ``_keep_in_fp32_modules`` parts stay float32), then moved to pageable
host memory where the engine is to place it.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from . import GiB, fixtures
from .measure import sync, to_host

# Wan 2.1 14B transformer: 40 blocks of 0.703 GB, 28.64 GB in all (bf16, fp32 islands).
WAN14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
              out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
              cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
# The same layout at width 128 (CPU smoke runs); text_dim stays 4096: the inputs below feed 4096.
WAN_TINY = dict(WAN14B, num_attention_heads=2, attention_head_dim=64, ffn_dim=256)
# Latents: an image-sized step, and 480p x 81 frames (21 latent frames).
WORKLOADS = {"small": (1, 16, 1, 64, 64), "video": (1, 16, 21, 60, 104)}


def nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    fixtures()
    from fixtures.meta_models import cast_like_from_pretrained as cast

    return cast(model, dtype).requires_grad_(False)


# -- Wan 2.1 14B geometry -------------------------------------------------------------------------
FP8_STORAGES = ("fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fn_fast")  # the loader's fp8 dtypes (_fast: fp8 matmuls)


def store_fp8_as(m: torch.nn.Module, storage: str, cast_each_forward: bool = False) -> None:
    """``m``'s Linear weights stored as the loader's fp8 dtype ``storage`` does, computing in bf16.
    ``cast_each_forward``: no kept piece is ever held as compute values (`held_casts.py`), so every
    unit casts at each forward, as at a small card: the every-block-kept row is then the reference
    on the capped rows' cast path (issue 23 asks for it), not the faster held one."""
    from diffusers_offload.offload_core.formats.fp8 import store_fp8  # after `benchkit.pack()`
    from diffusers_offload.offload_core.transport.held_casts import HeldCasts

    dtype = torch.float8_e5m2 if storage == "fp8_e5m2" else torch.float8_e4m3fn
    store_fp8(m, dtype, torch.bfloat16, matmul=storage.endswith("_fast"))
    if cast_each_forward:
        HeldCasts.fit = lambda self, room: self.drop() > 0


def wan_config(blocks: int, tiny: bool = False) -> dict[str, Any]:
    return dict(WAN_TINY if tiny else WAN14B, num_layers=blocks)


def build_wan(blocks: int, device: str | torch.device = "cuda", tiny: bool = False) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        m = WanTransformer3DModel(**wan_config(blocks, tiny))
    return cast_like_from_pretrained(m, torch.bfloat16)


def wan_inputs(name: str, frames: int, device: str | torch.device = "cuda") -> tuple:
    """(latents, text states 1x512x4096, timestep 500) of workload ``name``; ``frames`` latent
    frames for the video workload."""
    shape = list(WORKLOADS[name])
    if name == "video":
        shape[2] = frames
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    enc = torch.randn((1, 512, 4096), generator=g, device=device, dtype=torch.bfloat16)
    return x, enc, torch.full((1,), 500.0, device=device)


def wan_forward(m, x, enc, t) -> torch.Tensor:
    with torch.inference_mode():
        return m(hidden_states=x, encoder_hidden_states=enc, timestep=t, return_dict=False)[0]


def blocks_of(m: torch.nn.Module) -> list[torch.nn.Module]:
    """The streamed blocks in order: Wan's ``blocks``, Flux's two towers, Qwen-Image's
    ``transformer_blocks``, Z-Image's main ``layers``."""
    if hasattr(m, "single_transformer_blocks"):
        return [*m.transformer_blocks, *m.single_transformer_blocks]
    if hasattr(m, "transformer_blocks"):
        return list(m.transformer_blocks)
    return list(m.layers) if hasattr(m, "noise_refiner") else list(m.blocks)


# -- MiniMax-H3 at full width, reduced depth ------------------------------------------------------
# The suite's tiny H3 (tests/fixtures/tiny_models.build_tiny_h3), with 4 text layers.
H3_TINY_TEXT = dict(
    text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8, max_position_embeddings=4096,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                      "mrope_interleaved": True}),
    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=16, num_position_embeddings=16,
                       deepstack_visual_indexes=[0]),
)
H3_TINY_TRANSFORMER = dict(num_attention_heads=2, attention_head_dim=12, hidden_size=24, num_refiner_layers=1,
                           ffn_dim=32, in_channels=4, audio_in_channels=4, patch_size=(1, 2, 2), text_dim=16,
                           freq_dim=16, time_embed_hidden_dim=16, time_embed_dim=16, rope_freq_dim=2)
H3_TINY_VAE = dict(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
                   decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
                   decoder_num_register_tokens=1, decoder_ffn_mult=1, latents_mean=(0.0,) * 4,
                   latents_std=(1.0,) * 4)
H3_TINY_AUDIO_VAE = dict(encoder_dim=4, encoder_rates=(2, 2), latent_dim=8, latent_channels=4, num_attention_heads=2,
                         decoder_dim=8, decoder_rates=(2, 2), decoder_kernel_sizes=(4, 4), resblock_kernel_sizes=(3,),
                         resblock_dilation_sizes=((1,),), sampling_rate=160, latents_mean=[0.0] * 4,
                         latents_std=[1.0] * 4)
H3_AUDIO_VAE = dict(latents_mean=[0.0] * 32, latents_std=[1.0] * 32)  # the real config, plus the stats it needs
# Qwen3-VL's shipped image processor: 16 px patches, 2x2 merge, 256x256 .. 4096x4096 pixels.
H3_PIXELS, H3_TINY_PIXELS = (256 * 256, 4096 * 4096), (32 * 32, 64 * 64)


def _h3_processor(tokenizer, pixels: tuple[int, int]):
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor
    from transformers.utils import is_torchvision_available

    image = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=pixels[0],
                                     max_pixels=pixels[1])
    if is_torchvision_available():
        from transformers import Qwen3VLVideoProcessor

        video = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
        return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video)
    # Without torchvision the processor refuses a missing video processor; t2va/fl2va never use it
    # (shared/reference/tiny_models/processor_shim.py does the same).
    if not getattr(Qwen3VLProcessor, "_bench_shim", False):
        original = Qwen3VLProcessor.get_attributes.__func__
        Qwen3VLProcessor.get_attributes = classmethod(lambda cls: [a for a in original(cls) if a != "video_processor"])
        Qwen3VLProcessor.video_processor = None
        Qwen3VLProcessor._bench_shim = True
    return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer)


def _h3_text_config(tiny: bool, layers: int, tokenizer):
    from fixtures.meta_models import H3_TEXT_ENCODER
    from fixtures.tiny_tok import QWEN_VISION_TOKENS
    from transformers import Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS}
    base = H3_TINY_TEXT if tiny else H3_TEXT_ENCODER
    text = dict(base["text_config"], num_hidden_layers=layers)
    if tiny:
        text["vocab_size"] = len(tokenizer)
    return Qwen3VLConfig(text_config=text, vision_config=dict(base["vision_config"]),
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def build_h3(tiny: bool, blocks: int, te_layers: int, device: torch.device, dtype: torch.dtype, on_built=None,
             build_other=None):
    """An fl2va ``MiniMaxH3ModularPipeline``: the transformer at the H3-33B width with ``blocks`` of
    its 50 blocks; Qwen3-VL-32B as the pack carries its config (tests/fixtures/meta_models.H3_TEXT_ENCODER) with
    ``te_layers`` of 64 layers (H3 reads ``hidden_states[50]``: a shorter stack reads its last but
    one); both VAEs at their real configs; the suite's byte-level tokenizer (its ids fit the real
    vocabulary). ``on_built(name, model, build_s, to_host_s)`` after each model. ``build_other(name,
    make)``: a model built another way, or None (``benchkit.h3_fp8.fp8_builder``: directly in fp8,
    its move to the host part of ``build_s``)."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines import MiniMaxH3Blocks
    from diffusers.schedulers import MiniMaxH3Scheduler
    from transformers import Qwen3VLForConditionalGeneration

    fixtures()
    from fixtures.tiny_tok import QWEN_VISION_TOKENS, tiny_qwen2_tokenizer

    tokenizer = tiny_qwen2_tokenizer(extra_special=QWEN_VISION_TOKENS)
    makers = {
        "transformer": lambda n=blocks: MiniMaxH3Transformer3DModel(**(H3_TINY_TRANSFORMER if tiny else {}), num_layers=n),
        "text_encoder": lambda n=te_layers: Qwen3VLForConditionalGeneration(_h3_text_config(tiny, n, tokenizer)),
        "vae": lambda: AutoencoderKLMiniMaxH3(**(H3_TINY_VAE if tiny else {})),
        "audio_vae": lambda: AutoencoderKLMiniMaxH3Audio(**(H3_TINY_AUDIO_VAE if tiny else H3_AUDIO_VAE)),
    }
    models: dict[str, torch.nn.Module] = {}
    torch.manual_seed(0)
    for name, make in makers.items():
        t0 = time.perf_counter()
        other = build_other(name, make) if build_other is not None else None
        if other is not None:
            models[name] = other
            if on_built is not None:
                on_built(name, models[name], time.perf_counter() - t0, None)
            continue
        with torch.device(device):
            model = make()
        cast_like_from_pretrained(model, dtype)
        sync()
        built = time.perf_counter() - t0
        host_s = to_host(model) if device.type == "cuda" else 0.0
        models[name] = model
        if on_built is not None:
            on_built(name, model, built, host_s)
    pipe = MiniMaxH3Blocks().get_workflow("fl2va").init_pipeline()
    pipe.update_components(**models, tokenizer=tokenizer,
                           processor=_h3_processor(tokenizer, H3_TINY_PIXELS if tiny else H3_PIXELS),
                           scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    layers = models["text_encoder"].config.text_config.num_hidden_layers
    if layers <= pipe.text_encoder_layer:  # H3 reads hidden_states[50]: read the last-but-one of a short stack
        pipe.__class__ = _reads_layer(type(pipe), layers - 1)
    return pipe


@functools.cache
def _reads_layer(base: type, layer: int) -> type:
    return type(base.__name__, (base,), {"text_encoder_layer": property(lambda self: layer)})


def h3_geometry(name: str, model: torch.nn.Module) -> dict:
    """Per-component sizes (GiB) for the bench's build rows."""
    if name == "transformer":
        blocks = model.transformer_blocks
        return dict(blocks=len(blocks), block_gib=nbytes(blocks[0]) / GiB,
                    non_block_gib=(nbytes(model) - sum(nbytes(b) for b in blocks)) / GiB,
                    refiner_gib=nbytes(model.token_refiner) / GiB)
    if name == "text_encoder":
        lm = model.model.language_model
        return dict(layers=len(lm.layers), layer_gib=nbytes(lm.layers[0]) / GiB, embed_gib=nbytes(lm.embed_tokens) / GiB,
                    vision_gib=nbytes(model.model.visual) / GiB, lm_head_gib=nbytes(model.lm_head) / GiB,
                    vision_blocks=len(model.model.visual.blocks))
    if name == "vae":
        return dict(encoder_gib=nbytes(model.encoder) / GiB, decoder_gib=nbytes(model.decoder) / GiB)
    return {}

"""The released values the carried configs are written from (``write_carried_configs.py``); the classes'
own defaults are used where they are the released model's. Sources: Wan: diffusers'
``scripts/convert_wan_to_diffusers.py`` (transformer sizes, the Wan 2.2 VAE less its ``clip_output``,
UniPC's flow shift, boundary ratios), google/umt5-xxl's config (ComfyUI's ``umt5_config_xxl.json``
agrees), Wan 2.1 I2V's CLIP ViT-H/14; FLUX.1: diffusers' defaults for its transformer, VAE and
schedulers, CLIP-L / T5-XXL (ComfyUI's ``sd1_clip_config.json`` and ``t5_config_xxl.json`` agree);
MiniMax-H3: diffusers' ``convert_minimax_h3_to_diffusers.py``, the video VAE's latent statistics from
ComfyUI's ``comfy/ldm/minimax/vae.py``, Qwen3-VL-32B's config (ComfyUI's ``Qwen3VL_32BConfig``) and
processors; LTX-2 19B: diffusers' ``convert_ltx2_to_diffusers.py`` (version "2.0"), gemma-3-12b-it's
config; Z-Image Turbo: Tongyi-MAI's released configs (ComfyUI's ``model_detection`` and
``Qwen3_4BConfig`` agree), ComfyUI's shift 3, Qwen3's chat template (ComfyUI's Z-Image prompt,
which the Qwen2.5 template ComfyUI ships would wrap in a system prompt); Qwen-Image: Qwen/Qwen-Image's
released configs (Qwen2.5-VL-7B-Instruct's, ComfyUI's ``Qwen25_7BVLI_Config``); FLUX.2: diffusers'
``scripts/convert_flux2_to_diffusers.py`` (below)."""

from __future__ import annotations

from dataclasses import dataclass, field

TRANSFORMER = dict(added_kv_proj_dim=None, attention_head_dim=128, cross_attn_norm=True, eps=1e-6, freq_dim=256,
                   patch_size=[1, 2, 2], qk_norm="rms_norm_across_heads", text_dim=4096)
SIZES = {"1.3B": dict(ffn_dim=8960, num_attention_heads=12, num_layers=30),
         "14B": dict(ffn_dim=13824, num_attention_heads=40, num_layers=40),
         "5B": dict(ffn_dim=14336, num_attention_heads=24, num_layers=30)}
UMT5_XXL = dict(d_ff=10240, d_kv=64, d_model=4096, decoder_start_token_id=0, dense_act_fn="gelu_new",
                eos_token_id=1, feed_forward_proj="gated-gelu", is_gated_act=True, layer_norm_epsilon=1e-6,
                num_decoder_layers=24, num_heads=64, num_layers=24, pad_token_id=0,
                relative_attention_max_distance=128, relative_attention_num_buckets=32, scalable_attention=True,
                tie_word_embeddings=False, vocab_size=256384)
CLIP_VIT_H = dict(hidden_act="gelu", hidden_size=1280, image_size=224, intermediate_size=5120, layer_norm_eps=1e-5,
                  num_attention_heads=16, num_hidden_layers=32, patch_size=14, projection_dim=1024)
CLIP_PROCESSOR = dict(crop_size={"height": 224, "width": 224}, size={"shortest_edge": 224}, do_center_crop=True,
                      do_convert_rgb=True, do_normalize=True, do_rescale=True, do_resize=True, resample=3,
                      image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
WAN22_VAE = dict(base_dim=160, z_dim=48, is_residual=True, in_channels=12, out_channels=12, decoder_base_dim=256,
                 scale_factor_temporal=4, scale_factor_spatial=16, patch_size=2, latents_mean=[
                     -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                     0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                     -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
                     -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                     0.3573, -0.0548, -0.1681, -0.0667], latents_std=[
                     0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                     0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                     0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                     0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744])


CLIP_L = dict(bos_token_id=0, eos_token_id=2, hidden_act="quick_gelu", hidden_size=768, intermediate_size=3072,
              layer_norm_eps=1e-5, max_position_embeddings=77, num_attention_heads=12, num_hidden_layers=12,
              pad_token_id=1, projection_dim=768, vocab_size=49408)
T5_XXL = dict(d_ff=10240, d_kv=64, d_model=4096, decoder_start_token_id=0, dense_act_fn="gelu_new", eos_token_id=1,
              feed_forward_proj="gated-gelu", is_gated_act=True, layer_norm_epsilon=1e-6, num_decoder_layers=24,
              num_heads=64, num_layers=24, pad_token_id=0, relative_attention_max_distance=128,
              relative_attention_num_buckets=32, tie_word_embeddings=False, vocab_size=32128)
FLUX_VAE = dict(block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, force_upcast=True, latent_channels=16, layers_per_block=2,
                sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159, use_post_quant_conv=False,
                use_quant_conv=False)
FLUX_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                      num_train_timesteps=1000)
FLUX_TOKENIZERS = {"tokenizer": {"comfyui": "sd1_tokenizer", "model_max_length": 77},  # (ComfyUI's says 8192)
                   "tokenizer_2": {"comfyui": "text_encoders/t5_tokenizer", "model_max_length": 512}}
FLUX = {"FLUX.1-dev": dict(guidance_embeds=True, shift=3.0, use_dynamic_shifting=True),
        "FLUX.1-schnell": dict(guidance_embeds=False, shift=1.0, use_dynamic_shifting=False),
        # black-forest-labs/FLUX.1-Kontext-dev: FLUX.1-dev's configs under FluxKontextPipeline (its model_index.json)
        "FLUX.1-Kontext-dev": dict(guidance_embeds=True, shift=3.0, use_dynamic_shifting=True,
                                   pipeline="FluxKontextPipeline")}


H3_VAE_STATS = dict(latents_mean=[  # ComfyUI's comfy/ldm/minimax/vae.py LATENTS_MEAN / LATENTS_STD
    0.858090341091156, -0.9606591463088989, 1.0661640167236328, -0.5090325474739075, -0.2727581858634949,
    -1.3675414323806763, -0.2553254961967468, -0.26907554268836975, -0.5376840829849243, -0.0464097298681736,
    0.6657370328903198, 0.19690127670764923, -0.5460608005523682, -0.4035342037677765, -0.23683024942874908,
    0.25928452610969543, -0.30133944749832153, 0.211341992020607, -1.1206848621368408, 0.3581933379173279,
    -0.04225143790245056, 0.2604829967021942, 0.22864092886447906, 0.7056031823158264], latents_std=[
    1.2223774194717407, 1.2767263650894165, 1.68317747116088865, 1.7549455165863037, 1.5636216402053833,
    2.194143533706665, 0.96531379222869875, 1.05698859691619875, 0.841948926448822, 0.7729952931404114,
    1.8955937623977661, 0.946841835975647, 0.7996809482574463, 0.44988900423049925, 0.7197399735450745,
    0.69362932443618775, 2.961095094680786, 2.7694199085235595, 3.0496184825897215, 2.1088054180145265,
    3.276226282119751, 3.1627357006073, 2.28168129920959475, 2.6127843856811525])
QWEN3_VL_32B_TEXT = dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                         max_position_embeddings=262144, rms_norm_eps=1e-6, attention_bias=False,
                         bos_token_id=151643, eos_token_id=151645,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": [24, 20, 20], "mrope_interleaved": True})
QWEN3_VL_32B_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
                           out_hidden_size=5120, deepstack_visual_indexes=[8, 16, 24])
QWEN3_VL_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                       vision_end_token_id=151653)
QWEN3_VL_PIXELS = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
H3_TOKENIZERS = {"tokenizer": {"comfyui": "text_encoders/qwen25_tokenizer"}}  # ComfyUI's H3 tokenizer reads it
H3_COMPONENTS = {  # name -> (library, class), in the order diffusers' conversion script writes them
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"), "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "processor": ("transformers", "Qwen3VLProcessor"), "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
    "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "transformer_ref": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "scheduler": ("diffusers", "MiniMaxH3Scheduler"), "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
}


Z_IMAGE_TRANSFORMER = dict(axes_lens=[1536, 512, 512])  # the class's defaults are the released model's but this
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
                rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=True, bos_token_id=151643,
                eos_token_id=151645)
QWEN3_CHAT = (  # Qwen3's template for what ZImagePipeline asks (user turns, a generation prompt, thinking on)
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}")
Z_IMAGE_TOKENIZERS = {"tokenizer": {"comfyui": "text_encoders/qwen25_tokenizer", "chat_template": QWEN3_CHAT}}

QWEN25_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=128000,
                         max_window_layers=28, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
QWEN25_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_channels=3, tokens_per_second=2)
QWEN_IMAGE_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
                            shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)
QWEN_IMAGE_TOKENIZERS = {"tokenizer": {"comfyui": "text_encoders/qwen25_tokenizer"}}
# Qwen/Qwen-Image-Edit, -2509, -2511: the pipeline class of each model_index.json; 2511's transformer
# config adds zero_cond_t (its reference latents at timestep 0: ComfyUI's __index_timestep_zero__). The
# processor's image configs are Qwen2.5-VL-7B-Instruct's (min_pixels 3136, max_pixels 12845056).
QWEN_IMAGE_EDIT = {"Qwen-Image-Edit": ("QwenImageEditPipeline", False),
                   "Qwen-Image-Edit-2509": ("QwenImageEditPlusPipeline", False),
                   "Qwen-Image-Edit-2511": ("QwenImageEditPlusPipeline", True)}
QWEN25_VL_PIXELS = dict(patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073],
                        image_std=[0.26862954, 0.26130258, 0.27577711], size={"shortest_edge": 3136, "longest_edge": 12845056})


LTX2_TRANSFORMER = dict(  # diffusers' convert_ltx2_to_diffusers.py, version "2.0" (LTX-2 19B)
    in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32, attention_head_dim=128,
    cross_attention_dim=4096, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20, base_height=2048, base_width=2048,
    gated_attn=False, cross_attn_mod=False, audio_in_channels=128, audio_out_channels=128, audio_patch_size=1,
    audio_patch_size_t=1, audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
    audio_scale_factor=4, audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160,
    audio_gated_attn=False, audio_cross_attn_mod=False, num_layers=48, activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840,
    attention_bias=True, attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True, causal_offset=1,
    timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000, rope_type="split",
    use_prompt_embeddings=True, perturbed_attn=False)
LTX2_CONNECTORS = dict(
    caption_channels=3840, text_proj_in_factor=49, video_connector_num_attention_heads=30,
    video_connector_attention_head_dim=128, video_connector_num_layers=2, video_connector_num_learnable_registers=128,
    video_gated_attn=False, audio_connector_num_attention_heads=30, audio_connector_attention_head_dim=128,
    audio_connector_num_layers=2, audio_connector_num_learnable_registers=128, audio_gated_attn=False,
    connector_rope_base_seq_len=4096, rope_theta=10000.0, rope_double_precision=True,
    causal_temporal_positioning=False, rope_type="split", per_modality_projections=False, proj_bias=False)
LTX2_VAE = dict(  # the class defaults differ: decoder_causal, the compression ratios (it would compute 64 / 16)
    in_channels=3, out_channels=3, latent_channels=128, block_out_channels=(256, 512, 1024, 2048),
    down_block_types=("LTX2VideoDownBlock3D",) * 4, decoder_block_out_channels=(256, 512, 1024),
    layers_per_block=(4, 6, 6, 2, 2), decoder_layers_per_block=(5, 5, 5, 5), spatio_temporal_scaling=(True,) * 4,
    decoder_spatio_temporal_scaling=(True,) * 3, decoder_inject_noise=(False,) * 4,
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"), upsample_type=("spatiotemporal",) * 3,
    upsample_residual=(True,) * 3, upsample_factor=(2,) * 3, timestep_conditioning=False, patch_size=4, patch_size_t=1,
    resnet_norm_eps=1e-6, encoder_causal=True, decoder_causal=False, encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="reflect", spatial_compression_ratio=32, temporal_compression_ratio=8)
LTX2_SCHEDULER = dict(base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096)
LTX2 = {"LTX-2-19B-dev": dict(use_dynamic_shifting=True, shift_terminal=0.1),  # distilled: a fixed schedule
        "LTX-2-19B-distilled": dict(use_dynamic_shifting=False, shift_terminal=None)}
GEMMA3_12B_TEXT = dict(  # google/gemma-3-12b-it (ComfyUI's Gemma3_12B_Config agrees)
    vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=1024, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}, attention_bias=False,
    pad_token_id=0, bos_token_id=2, eos_token_id=1)
GEMMA3_VISION = dict(hidden_size=1152, image_size=896, intermediate_size=4304, num_attention_heads=16,
                     num_hidden_layers=27, patch_size=14, vision_use_head=False)
GEMMA3_TOKENS = dict(boi_token_index=255999, eoi_token_index=256000, image_token_index=262144, mm_tokens_per_image=256)


@dataclass(frozen=True)
class Variant:
    """One Wan-AI diffusers folder: its pipeline class, transformer size and channels, and flags."""

    pipeline: str
    size: str
    in_channels: int
    out_channels: int = 16
    two_experts: bool = False
    image_encoder: bool = False
    vae: dict = field(default_factory=dict)  # AutoencoderKLWan's own defaults are Wan 2.1's VAE
    flow_shift: float = 3.0
    flags: dict = field(default_factory=dict)


VARIANTS = {
    "Wan2.1-T2V-1.3B-Diffusers": Variant("WanPipeline", "1.3B", 16),
    "Wan2.1-T2V-14B-Diffusers": Variant("WanPipeline", "14B", 16),
    "Wan2.1-I2V-14B-480P-Diffusers": Variant("WanImageToVideoPipeline", "14B", 36, image_encoder=True),
    "Wan2.2-T2V-A14B-Diffusers": Variant("WanPipeline", "14B", 16, two_experts=True,
                                         flags={"boundary_ratio": 0.875, "expand_timesteps": False}),
    "Wan2.2-I2V-A14B-Diffusers": Variant("WanImageToVideoPipeline", "14B", 36, two_experts=True,
                                         flags={"boundary_ratio": 0.9, "expand_timesteps": False}),
    "Wan2.2-TI2V-5B-Diffusers": Variant("WanPipeline", "5B", 48, 48, vae=WAN22_VAE, flow_shift=5.0,
                                        flags={"boundary_ratio": None, "expand_timesteps": True}),
}


# FLUX.2 [klein] 4B / 9B: diffusers' scripts/convert_flux2_to_diffusers.py (the transformers' configs; the VAE is
# AutoencoderKLFlux2's defaults; the scheduler FLUX.1-dev's, as that script takes it), Qwen3-4B / Qwen3-8B as the text
# encoder, headless as ComfyUI's qwen_3_4b / qwen_3_8b files are read (ComfyUI's Qwen3_8BConfig agrees), the prompt
# read with Qwen3's chat template, thinking off (ComfyUI's Klein prompt template). The distilled and base models
# share every shape: the pipeline's is_distilled tells them apart.
FLUX2_KLEIN_TRANSFORMER = dict(patch_size=1, in_channels=128, attention_head_dim=128, timestep_guidance_channels=256,
                               mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6,
                               guidance_embeds=False)
FLUX2_KLEIN_SIZES = {"4B": dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680),
                     "9B": dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288)}
QWEN3_8B = dict(QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
FLUX2_KLEIN = {  # folder -> (size, text encoder, distilled)
    "FLUX.2-klein-4B": ("4B", QWEN3_4B, True), "FLUX.2-klein-base-4B": ("4B", QWEN3_4B, False),
    "FLUX.2-klein-9B": ("9B", QWEN3_8B, True), "FLUX.2-klein-base-9B": ("9B", QWEN3_8B, False),
}


# FLUX.2 [dev]: the same script's flux2-dev transformer (a guidance input: the class's default), the FLUX.2 VAE, FLUX.1-dev's
# scheduler; the text encoder Mistral Small 3.1's language model (a headless MistralModel, as ComfyUI's
# mistral_3_small_flux2 files hold it: its Mistral3Small24BConfig agrees; the pipeline reads hidden states 10, 20
# and 30), its tokenizer from the tekken vocabulary those files carry.
FLUX2_DEV_TRANSFORMER = dict(FLUX2_KLEIN_TRANSFORMER, num_layers=8, num_single_layers=48, num_attention_heads=48,
                             joint_attention_dim=15360, guidance_embeds=True)
MISTRAL_SMALL_24B_TEXT = dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                              max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000000.0,
                              sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                              pad_token_id=11)

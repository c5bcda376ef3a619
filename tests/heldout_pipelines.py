"""Tiny pipelines of families hsdp has no code for, built with diffusers' own classes at about the sizes of
diffusers' test suites (``get_dummy_components``), random weights from a fixed seed, written with
``save_pretrained``: what a user's downloaded folder looks like, at toy size. The tokenizers are hsdp's offline
byte-level tokenizer (there is no hub here); text encoders are the real ``transformers`` classes.

Each builder returns the pipeline object; :func:`build` writes it once into a folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hsdp.models.tiny import build_byte_tokenizer
from hsdp.models.tiny_flux import fill_zero_params

__all__ = ["BUILDERS", "FORMULA_ONLY", "build", "write_square_media"]


def _t5(d_model: int = 32, seed: int = 0):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(vocab_size=384, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=32,
                      feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)  # fmt: skip
    return T5EncoderModel(config).eval()


def _clip(hidden: int = 32, seed: int = 0, **config):
    from transformers import CLIPTextModelWithProjection

    from hsdp.models.tiny_flux import tiny_clip_text_config

    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(tiny_clip_text_config(384, hidden, **config)).eval()


def _tokenizer(max_length: int | None = None, chat: bool = False):
    tokenizer = build_byte_tokenizer()
    if max_length:
        tokenizer.model_max_length = max_length
    if chat:  # Z-Image and Qwen apply a chat template to the caption
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def _qwen_tokenizer(corpus: str):
    """A ``Qwen2Tokenizer`` (Qwen's pre-tokenizer and chat specials) over a byte-level BPE trained here on
    ``corpus``, the pipeline's own prompt template, with room to merge every word of it into one token: the
    template's prefix then has as many tokens as Qwen's own vocabulary gives it (Qwen-Image drops its first 34),
    and a caption's words fall back to byte tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = Qwen2Tokenizer()._tokenizer.pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    bpe.train_from_iterator([corpus], trainer)
    model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],
                               additional_special_tokens=specials[1:])  # fmt: skip
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def _llama3_tokenizer(corpus: str):
    """A ``PreTrainedTokenizerFast`` as Llama 3's loads: a byte-level BPE (trained here on ``corpus``) that puts
    ``<|begin_of_text|>`` before each text, ``<|end_of_text|>`` its end-of-sequence token (HiDream's pipeline pads
    with it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[bos, eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    bpe.train_from_iterator([corpus], trainer)
    bpe.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, bpe.token_to_id(bos))])  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos)


def _vae_kl(latent_channels: int = 4, seed: int = 0, levels: int = 2, **extra):
    """An ``AutoencoderKL`` compressing 2 ** (levels - 1) times (Lumina 2 and Z-Image assume 8: levels 4)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(block_out_channels=[8] * levels, in_channels=3, out_channels=3, norm_num_groups=4,
                         down_block_types=["DownEncoderBlock2D"] * levels,
                         up_block_types=["UpDecoderBlock2D"] * levels, latent_channels=latent_channels,
                         **extra).eval()  # fmt: skip


def chroma():
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                           axes_dims_rope=[4, 6, 6], approximator_num_channels=8,
                                           approximator_hidden_dim=16, approximator_layers=1)  # fmt: skip
    return ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae_kl(4, shift_factor=0.0609,
                          scaling_factor=1.5035), text_encoder=_t5(), tokenizer=_tokenizer(),
                          transformer=fill_zero_params(transformer))  # fmt: skip


def cogvideox():
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )

    torch.manual_seed(0)
    transformer = CogVideoXTransformer3DModel(num_attention_heads=4, attention_head_dim=8, in_channels=4,
                                              out_channels=4, time_embed_dim=2, text_embed_dim=32, num_layers=1,
                                              sample_width=2, sample_height=2, sample_frames=9, patch_size=2,
                                              temporal_compression_ratio=4, max_text_seq_length=226)  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
                                 up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                 latent_channels=4, layers_per_block=1, norm_num_groups=2,
                                 temporal_compression_ratio=4)  # fmt: skip
    # CogVideoX-2b's scheduler config (diffusers' test suite takes the class defaults: epsilon, no SNR changes)
    scheduler = CogVideoXDDIMScheduler(prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                       snr_shift_scale=3.0, timestep_spacing="trailing")  # fmt: skip
    return CogVideoXPipeline(tokenizer=_tokenizer(), text_encoder=_t5(), vae=vae.eval(),
                             transformer=fill_zero_params(transformer), scheduler=scheduler)  # fmt: skip


def ltx():
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                             num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
                                             num_layers=1, caption_channels=32)  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
                                decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                decoder_layers_per_block=(1, 1, 1, 1, 1),
                                spatio_temporal_scaling=(True, True, False, False),
                                decoder_spatio_temporal_scaling=(True, True, False, False),
                                decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4,
                                upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=1, patch_size_t=1,
                                encoder_causal=True, decoder_causal=False)  # fmt: skip
    return LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(), text_encoder=_t5(),
                       tokenizer=_tokenizer(), transformer=fill_zero_params(transformer))  # fmt: skip


def sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(sample_size=32, patch_size=1, in_channels=4, num_layers=1,
                                        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                        joint_attention_dim=32, pooled_projection_dim=64, out_channels=4)  # fmt: skip
    return StableDiffusion3Pipeline(
        transformer=fill_zero_params(transformer), scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_vae_kl(4, shift_factor=0.0609, scaling_factor=1.5035), text_encoder=_clip(32, 1),
        tokenizer=_tokenizer(77), text_encoder_2=_clip(32, 2), tokenizer_2=_tokenizer(77), text_encoder_3=_t5(32, 3),
        tokenizer_3=_tokenizer(),
    )  # fmt: skip


def lumina2():
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(0)
    transformer = Lumina2Transformer2DModel(sample_size=4, patch_size=2, in_channels=4, hidden_size=8,
                                            num_layers=2, num_attention_heads=1, num_kv_heads=1, multiple_of=16,
                                            ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0,
                                            axes_dim_rope=[4, 2, 2], cap_feat_dim=8)  # fmt: skip
    torch.manual_seed(0)
    encoder = Gemma2Model(Gemma2Config(head_dim=2, hidden_size=8, intermediate_size=37, num_attention_heads=4,
                                       num_hidden_layers=2, num_key_value_heads=2, vocab_size=384,
                                       pad_token_id=0))  # fmt: skip
    return Lumina2Pipeline(transformer=fill_zero_params(transformer), scheduler=FlowMatchEulerDiscreteScheduler(),
                           vae=_vae_kl(4, levels=4, shift_factor=0.0609, scaling_factor=0.3611), text_encoder=encoder.eval(),
                           tokenizer=_tokenizer())  # fmt: skip


def z_image():
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
                                           axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])  # fmt: skip
    torch.manual_seed(0)
    encoder = Qwen3Model(Qwen3Config(hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, vocab_size=384,
                                     max_position_embeddings=512, pad_token_id=0))  # fmt: skip
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae_kl(4, levels=4, shift_factor=0.0609,
                          scaling_factor=0.3611), text_encoder=encoder.eval(), tokenizer=_tokenizer(chat=True),
                          transformer=fill_zero_params(transformer))  # fmt: skip


def sana():
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(0)
    transformer = SanaTransformer2DModel(patch_size=1, in_channels=4, out_channels=4, num_layers=1,
                                         num_attention_heads=2, attention_head_dim=4, num_cross_attention_heads=2,
                                         cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
                                         sample_size=32)  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
                        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
                        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)),
                        decoder_qkv_multiscales=((), (5,)), encoder_layers_per_block=(1, 1),
                        decoder_layers_per_block=[1, 1], downsample_block_type="conv", upsample_block_type="interpolate",
                        decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407)  # fmt: skip
    torch.manual_seed(0)
    encoder = Gemma2Model(Gemma2Config(head_dim=16, hidden_size=8, initializer_range=0.02, intermediate_size=64,
                                       max_position_embeddings=8192, num_attention_heads=2, num_hidden_layers=1,
                                       num_key_value_heads=2, vocab_size=384, pad_token_id=0))  # fmt: skip
    return SanaPipeline(tokenizer=_tokenizer(), text_encoder=encoder.eval(), vae=vae.eval(),
                        transformer=fill_zero_params(transformer),
                        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))  # fmt: skip


def hidream():
    """HiDream-I1: a transformer that patchifies the latents itself, captioned by two CLIPs' pooled outputs, T5's
    hidden states and every layer's hidden states of Llama 3 (``[layers, batch, tokens, width]``: batch second), its
    prediction negated by the pipeline. The scheduler's shift is the one HiDream's training script loads it with
    (3.0); the CLIPs have 128 positions, as the pipeline pads their captions to 128 tokens."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        HiDreamImagePipeline,
        HiDreamImageTransformer2DModel,
    )
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    transformer = HiDreamImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                                 num_single_layers=1, attention_head_dim=8, num_attention_heads=4,
                                                 caption_channels=[32, 16], text_emb_dim=64, num_routed_experts=4,
                                                 num_activated_experts=2, axes_dims_rope=(4, 2, 2),
                                                 max_resolution=(32, 32), llama_layers=(0, 1))  # fmt: skip
    tokenizer = _llama3_tokenizer("a square number 0 1 2 3 of pixels")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=len(tokenizer),
                                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.eos_token_id))  # fmt: skip
    return HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_vae_kl(4, shift_factor=0.1159, scaling_factor=0.3611),
        text_encoder=_clip(32, 1, max_position_embeddings=128), tokenizer=_tokenizer(),
        text_encoder_2=_clip(32, 2, max_position_embeddings=128), tokenizer_2=_tokenizer(), text_encoder_3=_t5(32, 3),
        tokenizer_3=_tokenizer(), text_encoder_4=llama.eval(), tokenizer_4=tokenizer,
        transformer=fill_zero_params(transformer),
    )  # fmt: skip


def _qwen25_vl_text(vocab_size: int, seed: int = 0) -> dict:
    """diffusers' test-suite sizes of the Qwen2.5-VL text model (Qwen-Image, HunyuanVideo 1.5)."""
    torch.manual_seed(seed)
    return dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                rope_theta=1000000.0, vocab_size=vocab_size)  # fmt: skip


def qwen_image():
    """Qwen-Image: Qwen2.5-VL's last hidden states past the prompt template's first 34 tokens, a 3D VAE with
    per-channel statistics, latents packed 2 x 2 before the transformer."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=3, joint_attention_dim=16,
                                              guidance_embeds=False, axes_dims_rope=(8, 4, 4))  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.1] * 4, latents_std=[1.5] * 4)  # fmt: skip
    pipe = QwenImagePipeline(transformer=fill_zero_params(transformer), vae=vae.eval(),
                             scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=None, tokenizer=None)  # fmt: skip
    tokenizer = _qwen_tokenizer(pipe.prompt_template_encode)
    text = _qwen25_vl_text(len(tokenizer))
    vision = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16)
    specials = {"vision_start_token_id": 1, "vision_end_token_id": 2, "vision_token_id": 0}  # unused: no images
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                                                  hidden_size=16, vocab_size=len(tokenizer),
                                                                  **specials))  # fmt: skip
    pipe.register_modules(text_encoder=encoder.eval(), tokenizer=tokenizer)
    return pipe


def hunyuan_video15():
    """HunyuanVideo 1.5 text-to-video: two encoders (Qwen2.5-VL's hidden states past the chat template's system
    part; ByT5 on quoted glyph text), zero image-condition channels and a mask concatenated to the latents, zero
    image embeddings, classifier-free guidance by a guider component (at scale 6: diffusers' test suite sets 1, which
    guides nothing, so it would not show that training turns guidance off)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    torch.manual_seed(0)
    transformer = HunyuanVideo15Transformer3DModel(in_channels=9, out_channels=4, num_attention_heads=2,
                                                   attention_head_dim=8, num_layers=1, num_refiner_layers=1,
                                                   mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
                                                   text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=(2, 2, 4),
                                                   target_size=16, task_type="t2v")  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16),
                                      layers_per_block=1, spatial_compression_ratio=4, temporal_compression_ratio=2,
                                      downsample_match_channel=False, upsample_match_channel=False)  # fmt: skip
    pipe = HunyuanVideo15Pipeline(transformer=fill_zero_params(transformer), vae=vae.eval(),
                                  scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder=None,
                                  tokenizer=None, text_encoder_2=_t5(32), tokenizer_2=ByT5Tokenizer(),
                                  guider=ClassifierFreeGuidance(guidance_scale=6.0))  # fmt: skip
    tokenizer = _qwen_tokenizer(pipe.system_message)
    encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**_qwen25_vl_text(len(tokenizer))))
    pipe.register_modules(text_encoder=encoder.eval(), tokenizer=tokenizer)
    return pipe


def _wan(transformer_config: dict, vae_config: dict, **pipeline):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**vae_config).eval()
    denoisers = {}
    for i, name in enumerate(("transformer", "transformer_2")[: 2 if "boundary_ratio" in pipeline else 1]):
        torch.manual_seed(i)
        denoisers[name] = fill_zero_params(WanTransformer3DModel(**transformer_config))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=_tokenizer(), text_encoder=_t5(), vae=vae, scheduler=scheduler,
                       **{"transformer_2": None} | denoisers, **pipeline)  # fmt: skip


_WAN_TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=256,
                        ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                        rope_max_seq_len=32)  # fmt: skip


def wan22_ti2v():
    """Wan 2.2 TI2V-5B-shaped: the 48-channel VAE that patchifies 2 x 2 pixels (16x spatially), a timestep per
    token (``expand_timesteps``)."""
    vae = dict(base_dim=3, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
               latents_mean=[0.1] * 48, latents_std=[1.5] * 48, is_residual=True, in_channels=12, out_channels=12,
               patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16)  # fmt: skip
    # patch 1: a 32 x 32 item is 2 x 2 tokens (one token would leave attention's query and key gradients zero, and
    # AdamW would turn their rounding noise into lr-sized steps)
    return _wan(_WAN_TRANSFORMER | dict(in_channels=48, out_channels=48, patch_size=(1, 1, 1)), vae,
                expand_timesteps=True)


def wan22_a14b():
    """Wan 2.2 A14B-shaped: two experts, ``transformer`` above ``boundary_ratio`` x 1000, ``transformer_2`` below."""
    vae = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
               latents_mean=[0.1] * 16, latents_std=[1.5] * 16)  # fmt: skip
    return _wan(_WAN_TRANSFORMER | dict(in_channels=16, out_channels=16), vae, boundary_ratio=0.875)


BUILDERS = {"chroma": chroma, "cogvideox": cogvideox, "ltx": ltx, "sd3": sd3, "lumina2": lumina2,
            "z-image": z_image, "sana": sana, "wan2.2-ti2v": wan22_ti2v, "wan2.2-a14b": wan22_a14b,
            "qwen-image": qwen_image, "hunyuanvideo-1.5": hunyuan_video15}  # fmt: skip
FORMULA_ONLY = {"hidream": hidream}
"""Held-out pipelines that only tests/test_train_loss_formulas.py's formula test builds (HiDream: four encoders, a
mixture-of-experts transformer; training it at HSDP 2 and overfitting it as well would add to the suite's time)."""


def write_square_media(folder: Path, count: int = 4, side: int = 32) -> None:
    """``count`` captioned ``side`` x ``side`` images: one size bucket that every held-out pipeline's own size checks
    accept (LTX asks multiples of 32 in code, SD3 and Z-Image their VAE factor times the patch)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(folder / f"sq{i}.png")
        (folder / f"sq{i}.txt").write_text(f"a square number {i}")


def build(name: str, root: Path) -> Path:
    """The folder of held-out pipeline ``name`` under ``root`` (written once)."""
    folder = Path(root) / name
    if not (folder / "model_index.json").is_file():
        (BUILDERS | FORMULA_ONLY)[name]().save_pretrained(folder)
    return folder

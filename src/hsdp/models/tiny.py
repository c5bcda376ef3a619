"""Small built-in models with random weights and a fixed seed, saved as real checkpoints.

There is no model hub at run time, so the default demo and the tests build these from configs and write them
with ``save_pretrained`` (safetensors). They are then loaded through exactly the same path as a downloaded model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = [
    "TINY_SEED",
    "tiny_llama_config",
    "tiny_wan_transformer_config",
    "build_tiny_llama",
    "build_tiny_wan_transformer",
    "build_byte_tokenizer",
    "default_cache_dir",
]

TINY_SEED = 0


def default_cache_dir() -> Path:
    """Where built-ins are written, for every entry point (``hsdp``, ``scripts/demo.sh``, the tests, the Engine):
    ``$HSDP_CACHE``, else ``~/.cache/hsdp``."""
    return Path(os.environ.get("HSDP_CACHE", Path.home() / ".cache" / "hsdp"))


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    values = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def build_tiny_llama(seed: int = TINY_SEED, **overrides):
    """A Llama causal LM with tied embeddings (a few hundred thousand parameters)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides))
    return model.eval()


def tiny_wan_transformer_config(**overrides) -> dict:
    values = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=3,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    values.update(overrides)
    return values


def build_tiny_wan_transformer(seed: int = TINY_SEED, **overrides):
    """A Wan 2.x video DiT (``diffusers.WanTransformer3DModel``), small enough for a 2-core CPU."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**tiny_wan_transformer_config(**overrides))
    # Random init leaves some projections at zero (diffusers zero-inits outputs); give them values so that
    # parity tests compare real numbers.
    with torch.no_grad():
        for param in model.parameters():
            if param.abs().sum() == 0:
                param.normal_(0.0, 0.02)
    return model.eval()


def build_byte_tokenizer(vocab_size: int = 384):
    """A byte-level tokenizer built locally (no download): 256 byte tokens plus specials, as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split("", "isolated"),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )

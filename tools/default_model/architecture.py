"""The embedded model's shapes.

Budget: the checkpoint directory is at most 32 MB with bf16 weights, so about 15M parameters including the
tied embedding (8192 x 384) and the MTP head. Head sizes are the real family's (attention head_dim 256,
DeltaNet key/value head dim 128) so kernels tuned for Qwen3.5 shapes run it unchanged; layers follow the
family's pattern of one full-attention layer after three Gated DeltaNet layers, and DeltaNet has twice as
many value heads as key heads (27B has three times as many). Eight layers keep a CPU decode step cheap.
"""

from __future__ import annotations

from onestream.worker.config import ModelConfig

END_OF_TEXT_ID = 0
IM_END_ID = 2
VOCAB_SIZE = 8192


def default_config(vocab_size: int = VOCAB_SIZE) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=384,
        num_hidden_layers=8,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=256,
        intermediate_size=704,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=100_000.0,  # contexts are short; the family's 1e7 wastes most rotary frequencies
        partial_rotary_factor=0.25,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
        eos_token_ids=(END_OF_TEXT_ID, IM_END_ID),
        pad_token_id=END_OF_TEXT_ID,
    )


def smoke_config(vocab_size: int = VOCAB_SIZE) -> ModelConfig:
    """Same structure, tiny widths: for checking the training script end to end on a CPU."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        rope_theta=100_000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
        eos_token_ids=(END_OF_TEXT_ID, IM_END_ID),
        pad_token_id=END_OF_TEXT_ID,
    )


CONFIGS = {"default": default_config, "smoke": smoke_config}


def parameter_count(config: ModelConfig) -> int:
    import torch
    from onestream.worker.model import Qwen35ForCausalLM

    with torch.device("meta"):
        model = Qwen35ForCausalLM(config)
    return sum(p.numel() for p in model.parameters())

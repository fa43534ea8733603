"""Random bf16 models built directly on the GPU, for kernel tests and benchmarks.

The scales follow `onestream.worker.testing.random_weights` (matrices N(0, 1/fan_in), embeddings and lm_head
scaled for peaked next-token distributions, norms near their identity), but the tensors are drawn on the
device: a 27B-shaped model would take minutes of host time otherwise.
"""

from __future__ import annotations

import math

import torch
from onestream.worker.config import ModelConfig
from onestream.worker.layers.attention import RotaryEmbedding
from onestream.worker.model import Qwen35ForCausalLM

LOGIT_STD = 5.0  # standard deviation of the logits that the embedding/lm_head scale aims at


def config_27b(num_layers: int = 64, *, full_attention_interval: int = 4, mtp: bool = False) -> ModelConfig:
    """The Qwen3.5/3.6-27B text shapes with `num_layers` layers (every 4th full attention), with the MTP head
    (one layer) if `mtp`."""
    layer_types = tuple(
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_layers)
    )
    return ModelConfig(
        vocab_size=248320,
        hidden_size=5120,
        num_hidden_layers=num_layers,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        intermediate_size=17408,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        layer_types=layer_types,
        tie_word_embeddings=False,
        mtp_num_hidden_layers=1 if mtp else 0,
    )


@torch.no_grad()
def random_model(
    config: ModelConfig, *, seed: int = 0, device: str | torch.device = "cuda"
) -> Qwen35ForCausalLM:
    """A bf16 `Qwen35ForCausalLM` with fresh random weights drawn on `device`.

    Built on the meta device and cast to bf16 there, then materialised on `device`: the model's own fp32
    construction would need twice the final memory (104 GB for the 27B shapes)."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = Qwen35ForCausalLM(config)
    model = model.to(torch.bfloat16)  # A_log and dt_bias stay fp32 (GatedDeltaNet._apply)
    model = model.to_empty(device=device)
    model.rotary = RotaryEmbedding(config)  # its inv_freq was made on the meta device
    embed_std = LOGIT_STD / math.sqrt(config.hidden_size)
    for name, param in model.named_parameters():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            param.normal_(0.0, embed_std, generator=generator)
        elif name.endswith("linear_attn.norm.weight"):
            param.normal_(1.0, 0.1, generator=generator)
        elif name.endswith(".A_log"):
            param.uniform_(1.0, 16.0, generator=generator).log_()
        elif name.endswith(".dt_bias"):
            param.normal_(0.0, 0.1, generator=generator)
        elif name.endswith("conv1d.weight"):
            param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]), generator=generator)
        elif param.ndim == 2:
            param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]), generator=generator)
        else:  # the zero-centred (1 + w) norms, near identity
            param.normal_(0.0, 0.1, generator=generator)
    model.eval()
    return model

"""Prefill at the hardware's pace: long prompt pieces on kernels made for them (`FastPrefill`), writing the
state the reference model and the megakernel continue from."""

from .attention import attention_prefill, causal_attention
from .deltanet import DeltaRuleKernel, chunk_gated_delta_rule_torch, deltanet_prefill
from .runner import DEFAULT_PIECE_TOKENS, FastPrefill, operator_piece_tokens, piece_tokens_from_env

__all__ = [
    "DEFAULT_PIECE_TOKENS",
    "DeltaRuleKernel",
    "FastPrefill",
    "attention_prefill",
    "causal_attention",
    "chunk_gated_delta_rule_torch",
    "deltanet_prefill",
    "operator_piece_tokens",
    "piece_tokens_from_env",
]

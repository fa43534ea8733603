"""The MTP head over whole sequences at several draft depths, exactly as speculative decoding runs it.

When the engine drafts k tokens after position p, draft 1 runs the MTP layer on (t[p+1], H[p]) at MTP
position p, whose attention sees the depth-1 entries of every position <= p. Draft d > 1 feeds the previous
draft token with the MTP layer's own normed output at position p + d - 1; its attention sees the same
depth-1 entries (positions <= p) and the entries drafts 2..d wrote for this chain. Training depth d for
every p at once therefore needs, per query, the causal depth-1 keys plus a few keys on the diagonal of
the deeper depths: one attention over the concatenated keys with a boolean mask.

Teacher forcing feeds the true token t[p+d] where the engine feeds its draft; when the drafts are right
(the only case whose acceptance matters) the two are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from onestream.worker.model import Qwen35ForCausalLM


def chain_mask(length: int, depth: int, device: torch.device) -> torch.Tensor:
    """Boolean `[T, depth * T]`: query j sees depth-1 keys 0..j and the deeper depths' keys at j only."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * (depth - 1), dim=1)


def chained_mtp_forward(
    model: Qwen35ForCausalLM,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    depths: int,
    *,
    with_logits: bool = True,
) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """Drafts at depths 1..`depths` for every base position.

    `tokens [B, T + depths]` is the window the main model saw from its position 1 on (tokens[:, j] = t[j+1]),
    `hidden [B, T, H]` the main model's post-norm hidden states H[0..T-1]. Returns per depth d the draft
    logits `[B, T, V]` (fp32; row j predicts t[j+d+1]; None without `with_logits`) and the MTP layer's
    normed output.
    """
    mtp = model.mtp
    layer = mtp.layer
    attn = layer.self_attn
    b, t, _ = hidden.shape
    if tokens.shape[0] != b or tokens.shape[1] < t + depths - 1:
        raise ValueError(f"tokens must have at least {t + depths - 1} columns, got {tuple(tokens.shape)}")
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    previous = hidden
    outputs = []
    for d in range(1, depths + 1):
        x = mtp.fuse(model.model.embed_tokens(tokens[:, d - 1 : d - 1 + t]), previous.to(model.dtype))
        positions = torch.arange(d - 1, d - 1 + t, device=x.device)
        cos, sin = model.rotary(positions, x.dtype)
        q, k, v, gate = attn._project(layer.input_layernorm(x), cos, sin)
        keys.append(k)
        values.append(v)
        if d == 1:
            mixed = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=attn.scale, enable_gqa=attn._gqa
            )
        else:
            all_keys, all_values = torch.cat(keys, dim=2), torch.cat(values, dim=2)
            if attn._gqa:  # the masked kernels take equal head counts
                repeat = attn.num_heads // attn.num_kv_heads
                all_keys = all_keys.repeat_interleave(repeat, dim=1)
                all_values = all_values.repeat_interleave(repeat, dim=1)
            mixed = F.scaled_dot_product_attention(
                q, all_keys, all_values, attn_mask=chain_mask(t, d, x.device), scale=attn.scale
            )
        h = layer._mlp_residual(x + attn._finish(mixed, gate))
        out = mtp.norm(h)
        outputs.append((model._logits(out) if with_logits else None, out))
        previous = out
    return outputs

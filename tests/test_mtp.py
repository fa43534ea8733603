"""The MTP head against an independent, straightforward float64 implementation written here.

Convention (vLLM): pair j = (token t[p+1], hidden H[p]) at MTP position p:
e = pre_fc_norm_embedding(embed(t)), h = pre_fc_norm_hidden(H), x = fc([e, h]), one full-attention decoder
layer at RoPE position p over the MTP layer's own cache, out = mtp.norm(x), logits = lm_head(out).
"""

from __future__ import annotations

import math

import pytest
import torch
from onestream.worker.errors import InvalidRequestError, UnsupportedModelError
from onestream.worker.model import Qwen35ForCausalLM
from onestream.worker.testing import random_weights, tiny_config

torch.set_num_threads(2)


# ---- the independent reference: explicit loops, float64 --------------------------------------------
def ref_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean() + eps) * (1.0 + w)


def ref_rope(x: torch.Tensor, pos: int, rotary_dim: int, theta: float) -> torch.Tensor:
    """Rotate pairs (i, i + rotary_dim/2) of the first rotary_dim dims by pos * theta^(-2i/rotary_dim)."""
    out = x.clone()
    half = rotary_dim // 2
    for i in range(half):
        angle = pos * theta ** (-2.0 * i / rotary_dim)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def ref_mtp(
    weights: dict[str, torch.Tensor], cfg, pairs: list[tuple[int, torch.Tensor]]
) -> tuple[list, list]:
    """Logits and normed outputs for MTP positions 0..len(pairs)-1, one position at a time."""
    w = {k: v.double() for k, v in weights.items()}
    eps, nh, nkv, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    a = "mtp.layers.0.self_attn."
    keys, values, logits, outs = [], [], [], []
    for p, (token, hidden) in enumerate(pairs):
        e = ref_rmsnorm(w["model.embed_tokens.weight"][token], w["mtp.pre_fc_norm_embedding.weight"], eps)
        h = ref_rmsnorm(hidden.double(), w["mtp.pre_fc_norm_hidden.weight"], eps)
        x = w["mtp.fc.weight"] @ torch.cat([e, h])
        # attention block
        y = ref_rmsnorm(x, w["mtp.layers.0.input_layernorm.weight"], eps)
        qg = (w[a + "q_proj.weight"] @ y).view(nh, 2 * d)
        k = (w[a + "k_proj.weight"] @ y).view(nkv, d)
        v = (w[a + "v_proj.weight"] @ y).view(nkv, d)
        keys.append(
            [
                ref_rope(ref_rmsnorm(k[j], w[a + "k_norm.weight"], eps), p, cfg.rotary_dim, cfg.rope_theta)
                for j in range(nkv)
            ]
        )
        values.append([v[j] for j in range(nkv)])
        attn = []
        for i in range(nh):
            q = ref_rope(
                ref_rmsnorm(qg[i, :d], w[a + "q_norm.weight"], eps), p, cfg.rotary_dim, cfg.rope_theta
            )
            j = i // (nh // nkv)
            scores = torch.stack([q @ keys[s][j] for s in range(p + 1)]) / math.sqrt(d)
            probs = torch.softmax(scores, 0)
            o = sum(probs[s] * values[s][j] for s in range(p + 1))
            attn.append(o * torch.sigmoid(qg[i, d:]))
        x = x + w[a + "o_proj.weight"] @ torch.cat(attn)
        # MLP block
        m = "mtp.layers.0.mlp."
        y = ref_rmsnorm(x, w["mtp.layers.0.post_attention_layernorm.weight"], eps)
        x = x + w[m + "down_proj.weight"] @ (
            torch.nn.functional.silu(w[m + "gate_proj.weight"] @ y) * (w[m + "up_proj.weight"] @ y)
        )
        out = ref_rmsnorm(x, w["mtp.norm.weight"], eps)
        outs.append(out)
        logits.append(head @ out)
    return logits, outs


# ---- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def setup(request):
    cfg = tiny_config(tie_word_embeddings=request.param, num_key_value_heads=1, partial_rotary_factor=0.5)
    weights = random_weights(cfg, seed=11)
    model = Qwen35ForCausalLM(cfg)
    model.load_state_dict(weights, strict=True)
    return cfg, weights, model.eval()


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-4 * scale + 1e-6, f"max diff {err:.3g} (scale {scale:.3g})"


def test_mtp_step_with_cache_and_drafting(setup):
    cfg, weights, model = setup
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (24,), generator=g)
    main = model.forward_step(tokens, model.new_state(64))  # H[p] for p < 24
    state = model.new_state(64)
    # teacher-forced MTP positions 0..22 in three calls (pairs t[p+1], H[p])
    got_logits, got_hidden = [], []
    for a, b in [(0, 9), (9, 10), (10, 23)]:
        out = model.mtp_step(tokens[a + 1 : b + 1], main.hidden[a:b], state)
        got_logits.append(out.logits)
        got_hidden.append(out.hidden)
    assert state.mtp_length == 23
    pairs = [(int(tokens[p + 1]), main.hidden[p]) for p in range(23)]
    # then three draft steps: the next token with the MTP layer's own output, greedy
    nxt, hid = int(main.logits[-1].argmax()), main.hidden[-1]
    pairs.append((nxt, hid))
    for _ in range(3):
        out = model.mtp_step(torch.tensor([nxt]), hid.unsqueeze(0), state)
        got_logits.append(out.logits)
        got_hidden.append(out.hidden)
        nxt, hid = int(out.logits[0].argmax()), out.hidden[0]
        pairs.append((nxt, hid))
    want_logits, want_hidden = ref_mtp(weights, cfg, pairs[:-1])
    assert state.mtp_length == 26
    assert_close(torch.cat(got_logits), torch.stack(want_logits))
    assert_close(torch.cat(got_hidden), torch.stack(want_hidden))
    top = torch.stack(want_logits).softmax(-1).max(-1).values
    assert (top > 0.5).double().mean() > 0.25, "MTP distributions too flat to test anything"


def test_mtp_rollback_then_recompute(setup):
    cfg, weights, model = setup
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, cfg.vocab_size, (12,), generator=g)
    hidden = torch.randn(12, cfg.hidden_size, generator=g)
    other = torch.randint(0, cfg.vocab_size, (3,), generator=g)
    state = model.new_state(32)
    model.mtp_step(tokens, hidden, state)
    state.rollback_mtp(3)
    assert state.mtp_length == 9
    out = model.mtp_step(other, hidden[9:], state)
    pairs = [(int(t), h) for t, h in zip(torch.cat([tokens[:9], other]), hidden, strict=True)]
    want_logits, _ = ref_mtp(weights, cfg, pairs)
    assert_close(out.logits, torch.stack(want_logits[9:]))


def test_mtp_forward_batched(setup):
    cfg, weights, model = setup
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (2, 10), generator=g)
    hidden = torch.randn(2, 10, cfg.hidden_size, generator=g)
    logits, out = model.mtp_forward(tokens, hidden)
    assert logits.shape == (2, 10, cfg.vocab_size) and out.shape == (2, 10, cfg.hidden_size)
    for b in range(2):
        want_logits, want_out = ref_mtp(
            weights, cfg, [(int(t), h) for t, h in zip(tokens[b], hidden[b], strict=True)]
        )
        assert_close(logits[b], torch.stack(want_logits))
        assert_close(out[b], torch.stack(want_out))


def test_mtp_forward_is_differentiable(setup):
    cfg, _, model = setup
    tokens = torch.randint(0, cfg.vocab_size, (1, 6))
    hidden = torch.randn(1, 6, cfg.hidden_size)
    logits, _ = model.mtp_forward(tokens, hidden)
    logits.logsumexp(-1).sum().backward()
    assert model.mtp.fc.weight.grad is not None and model.mtp.fc.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_mtp_bad_inputs(setup):
    cfg, _, model = setup
    state = model.new_state(8)
    with pytest.raises(InvalidRequestError, match="hidden"):
        model.mtp_step(torch.tensor([1, 2]), torch.zeros(3, cfg.hidden_size), state)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        model.mtp_step(torch.tensor([cfg.vocab_size]), torch.zeros(1, cfg.hidden_size), state)
    assert state.mtp_length == 0
    no_mtp = Qwen35ForCausalLM(tiny_config(mtp_num_hidden_layers=0))
    with pytest.raises(UnsupportedModelError, match="MTP"):
        no_mtp.mtp_step(torch.tensor([1]), torch.zeros(1, cfg.hidden_size), no_mtp.new_state(4))

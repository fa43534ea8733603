"""Gated DeltaNet (the linear-attention mixer of Qwen3.5): causal conv1d state and fp32 delta-rule state.

Per value head, with state S `[dk, dv]`, decay g <= 0 and write strength beta in (0, 1):
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
with q, k l2-normalised (q also scaled by dk^-0.5). Value head j reads key head j // (Hv / Hk).
Long inputs use the equivalent chunked (WY / UT-transform) form, chunk 64, like transformers' torch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .norms import GatedRMSNorm

CHUNK = 64
L2NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def expand_key_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """`[..., Hk, d]` -> `[..., Hv, d]`, value head j using key head j // (Hv / Hk)."""
    hk = x.shape[-2]
    if hk == num_v_heads:
        return x
    rep = num_v_heads // hk
    return (
        x.unsqueeze(-2)
        .expand(*x.shape[:-1], rep, x.shape[-1])
        .reshape(*x.shape[:-2], num_v_heads, x.shape[-1])
    )


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, per-value-head, l2-normalised q (scaled by dk^-0.5) and k."""
    q = l2_normalize(expand_key_heads(q, num_v_heads).float())
    k = l2_normalize(expand_key_heads(k, num_v_heads).float())
    return q * q.shape[-1] ** -0.5, k


def split_chunks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, ...]:
    """Pad T to whole chunks and view the inputs per chunk: q, k, v `[B, H, n, C, d]`, beta `[B, H, n, C]`, with
    the cumulative log-decay c `[B, H, n, C]` and decay `[B, H, n, C, C]`: e^{c_t - c_s} for s <= t, else 0."""
    b, h, t, _ = k.shape
    pad = (-t) % chunk
    if pad:  # zero k and beta make padded steps no-ops; zero g leaves the decay alone
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    cum = g.cumsum(-1)  # c_t
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # masked before exp, so that the entries above the diagonal cannot overflow
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    return q, k, v, beta, cum, decay


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over whole sequences, chunk by chunk.

    q, k `[B, H, T, dk]` (prepared by `prepare_qk`), v `[B, H, T, dv]`, g, beta `[B, H, T]`, all fp32;
    initial_state `[B, H, dk, dv]` or None (zeros). Returns (out `[B, H, T, dv]`, final state) in fp32.

    Within a chunk with cumulative log-decay c_t, the writes u_t = beta_t (v_t - S_{t-1}^T k_t) solve the
    unit-lower-triangular system (I + A) U = beta V - diag(beta e^c) K S0 with
    A_ts = beta_t e^{c_t - c_s} k_t.k_s (s < t); then o_t = e^{c_t} S0^T q_t + sum_{s<=t} e^{c_t-c_s} (q_t.k_s) u_s
    and the chunk's final state is e^{c_C} S0 + sum_s e^{c_C - c_s} k_s u_s^T.
    """
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    q, k, v, beta, cum, decay = split_chunks(q, k, v, g, beta, chunk)
    n = q.shape[2]
    kb = k * beta.unsqueeze(-1)
    system = (kb @ k.transpose(-1, -2)) * decay  # diagonal ignored: unitriangular solve
    solved_v = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    solved_k = torch.linalg.solve_triangular(
        system, kb * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    outs = []
    for i in range(n):
        u = solved_v[:, :, i] - solved_k[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + scores[:, :, i] @ u)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return out, state


def recurrent_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token, updating `state [H, dk, dv]` (fp32) in place. q, k `[H, dk]` prepared, v `[H, dv]`, g, beta `[H]`."""
    state.mul_(g.exp()[:, None, None])
    read = torch.bmm(k.unsqueeze(1), state).squeeze(1)  # S^T k, [H, dv]
    delta = (v.float() - read) * beta.float()[:, None]
    state.baddbmm_(k.unsqueeze(2), delta.unsqueeze(1))
    return torch.bmm(q.unsqueeze(1), state).squeeze(1)


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer. `A_log` and `dt_bias` stay fp32 whatever dtype the module is cast to."""

    FP32_PARAMS = ("A_log", "dt_bias")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = config.linear_qkv_dim
        self.kernel = config.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log())
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Casting the model to bf16/fp16 must not round the decay parameters: keep them fp32.
        keep = {name: getattr(self, name).data for name in self.FP32_PARAMS}
        super()._apply(fn, recurse)
        for name, old in keep.items():
            param = getattr(self, name)
            if param.dtype != torch.float32:
                param.data = old.to(device=param.device, dtype=torch.float32)
        return self

    # ---- shared pieces --------------------------------------------------------------------------------
    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta = sigmoid(b) (in the model dtype, as transformers), g = -exp(A_log) softplus(a + dt_bias) in fp32."""
        return self._gate_values(self.in_proj_b(x), self.in_proj_a(x))

    def _gate_values(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(beta, g) from the projections b = in_proj_b(x) and a = in_proj_a(x)."""
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return beta, g

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv output `[..., C]` -> q, k `[..., Hk, dk]`, v `[..., Hv, dv]`."""
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        lead = mixed.shape[:-1]
        return (
            q.reshape(*lead, self.num_k_heads, self.head_k_dim),
            k.reshape(*lead, self.num_k_heads, self.head_k_dim),
            v.reshape(*lead, self.num_v_heads, self.head_v_dim),
        )

    def _output(self, core: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """core `[..., Hv, dv]` (model dtype) -> gated norm with z -> out_proj."""
        z = self.in_proj_z(x).reshape(*core.shape)
        return self.out_proj(self.norm(core, z).reshape(*x.shape[:-1], self.value_dim))

    def _conv(self, window: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Depthwise conv without padding over `window [B, C, L]` -> silu, `[B, C, L - kernel + 1]`."""
        out = F.conv1d(window.to(self.conv1d.weight.dtype), self.conv1d.weight, groups=self.conv_dim)
        return F.silu(out).to(dtype)

    # ---- stateless, batched ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, H]` from a zero state -> `[B, T, H]` (chunked form; differentiable)."""
        mixed = self._conv(F.pad(self.in_proj_qkv(x).transpose(1, 2), (self.kernel - 1, 0)), x.dtype)
        q, k, v = self._split(mixed.transpose(1, 2))
        beta, g = self._gates(x)
        q, k = prepare_qk(q, k, self.num_v_heads)
        out, _ = chunked_delta_rule(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.float().transpose(1, 2),
            g.transpose(1, 2),
            beta.float().transpose(1, 2),
        )
        return self._output(out.transpose(1, 2).to(x.dtype), x)

    # ---- one sequence, with state ---------------------------------------------------------------------
    def step(
        self, x: torch.Tensor, conv_state: torch.Tensor, recurrent: torch.Tensor, *, keep_states: bool = False
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Continue one sequence with `x [T, H]`, updating `conv_state [C, kernel-1]` and `recurrent [Hv, dk, dv]`
        in place. With `keep_states`, also return the (conv, recurrent) states after each token,
        `[T, C, kernel-1]` and `[T, Hv, dk, dv]`; those steps use the recurrent form token by token."""
        t = x.shape[0]
        window = torch.cat((conv_state, self.in_proj_qkv(x).T), dim=1)  # [C, kernel-1+T]
        if t == 1:
            w = self.conv1d.weight[:, 0, :]
            mixed = F.silu((window.to(w.dtype) * w).sum(-1)).to(x.dtype).unsqueeze(0)
        else:
            mixed = self._conv(window.unsqueeze(0), x.dtype)[0].T
        conv_history = None
        if keep_states:
            span = self.kernel - 1
            conv_history = torch.stack([window[:, i + 1 : i + 1 + span] for i in range(t)])
        conv_state.copy_(window[:, t:])

        q, k, v = self._split(mixed)
        beta, g = self._gates(x)
        q, k = prepare_qk(q, k, self.num_v_heads)
        if t == 1 or keep_states:
            outs, states = [], []
            for i in range(t):
                outs.append(recurrent_delta_step(q[i], k[i], v[i], g[i], beta[i], recurrent))
                if keep_states:
                    states.append(recurrent.clone())
            out = torch.stack(outs)
        else:
            out, final = chunked_delta_rule(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.float().transpose(0, 1)[None],
                g.T[None],
                beta.float().T[None],
                initial_state=recurrent[None],
            )
            recurrent.copy_(final[0])
            out = out[0].transpose(0, 1)
        history = (conv_history, torch.stack(states)) if keep_states else None
        return self._output(out.to(x.dtype), x), history

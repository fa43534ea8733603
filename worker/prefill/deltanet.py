"""Gated DeltaNet over a prompt: the chunked (WY / UT-transform) delta rule and the layer around it.

Two kernels compute the same recurrence (worker/layers/deltanet.py has its definition):
- "torch": the chunked form below, in PyTorch, on any device. Everything but the state pass is batched over
  the chunks; the state pass is two batched GEMMs per chunk.
- "fla": flash-linear-attention's Triton `chunk_gated_delta_rule` (what vLLM, SGLang and transformers run
  for this architecture), when the package imports on a CUDA device and agrees with "torch" on a probe.
  The package is optional: nothing here needs it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InvalidRequestError
from ..layers.deltanet import GatedDeltaNet, l2_normalize
from .elementwise import Elementwise

log = logging.getLogger(__name__)

KERNELS = ("auto", "fla", "torch")
KERNEL_ENV = "ONESTREAM_PREFILL_DELTANET"  # pins the kernel: fla, torch or auto (the default)
DEFAULT_CHUNK = 64
# The probe that admits the fla kernel: its output and final state against the torch form's, relative to
# their scale. bf16 inputs round at about 4e-3; a kernel that maps heads or states differently is off by O(1).
PROBE_TOLERANCE = 3e-2
PROBE_HEADS = (2, 4, 128, 128)  # key heads, grouped value heads, key and value head dims


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, chunk by chunk, in fp32.

    q, k `[H, T, dk]` (l2-normalised, q also scaled), v `[H, T, dv]`, g (log decay) and beta `[H, T]`,
    initial_state `[H, dk, dv]`. Returns (out `[H, T, dv]`, final state `[H, dk, dv]`).

    In a chunk with cumulative log decay c_t the writes of the recurrence, v'_t = beta_t (v_t - S_{t-1}^T k_t),
    are v' = u - w S0 where (I + A) [u | w] = [beta v | beta e^c k] and A_ts = beta_t e^{c_t - c_s} k_t.k_s
    for s < t (the UT transform: one triangular solve per chunk, batched over all of them). The states at
    the chunk starts then follow one after the other, S' = e^{c_C} S + sum_s e^{c_C - c_s} k_s v'_s^T, and
    every output is o_t = e^{c_t} S0^T q_t + sum_{s<=t} e^{c_t - c_s} (q_t.k_s) v'_s, batched again.
    """
    if chunk < 1:
        raise InvalidRequestError(f"chunk must be positive, got {chunk}")
    h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:  # zero k and beta make the padded steps no-ops; zero g leaves the decay alone
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk

    def per_chunk(x: torch.Tensor) -> torch.Tensor:
        # chunk-major, so that each step of the state pass reads and writes contiguous blocks
        return x.reshape(h, n, chunk, *x.shape[2:]).transpose(0, 1).contiguous()

    q, k, v, g, beta = (per_chunk(x) for x in (q, k, v, g, beta))  # [n, H, C, d] and [n, H, C]
    cum = g.cumsum(-1)
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # masked before exp, so that the entries above the diagonal cannot overflow
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    kb = k * beta.unsqueeze(-1)
    system = (kb @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: a unit-triangular solve
    rhs = torch.cat((v * beta.unsqueeze(-1), kb * cum.exp().unsqueeze(-1)), dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split((dv, dk), -1)
    scores = (q @ k.transpose(-1, -2)) * decay
    to_end = (k * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2).contiguous()  # [n, H, dk, C]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [n, H, 1, 1]

    states = q.new_empty(n + 1, h, dk, dv)
    states[0] = initial_state
    writes = torch.empty_like(u)
    for i in range(n):
        torch.baddbmm(u[i], w[i], states[i], alpha=-1.0, out=writes[i])
        torch.mul(states[i], chunk_decay[i], out=states[i + 1])
        states[i + 1].baddbmm_(to_end[i], writes[i])
    out = (q * cum.exp().unsqueeze(-1)) @ states[:n] + scores @ writes  # [n, H, C, dv]
    return out.transpose(0, 1).reshape(h, n * chunk, dv)[:, :t], states[n].clone()


def expected_kernel() -> str:
    """The kernel a CUDA device's prefill will run as far as can be told without a device to probe on (what
    `serve` plans a card's memory with before the card loads): the pinned one, else fla where the package is
    installed (its probe decides when the back end is made), else torch."""
    kind = os.environ.get(KERNEL_ENV, "auto")
    if kind in ("fla", "torch"):
        return kind
    return "fla" if importlib.util.find_spec("fla") is not None else "torch"


def _fla_function() -> Callable[..., Any] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # type: ignore[import-not-found]
    except Exception as e:  # absent, or present but broken (a Triton it cannot use): the torch form runs
        log.debug("flash-linear-attention is not usable: %s", e)
        return None
    return chunk_gated_delta_rule  # type: ignore[no-any-return]


class DeltaRuleKernel:
    """The delta-rule kernel of a prefill: `fla` where it imports and passes the probe, else `torch`."""

    def __init__(
        self,
        device: torch.device,
        kind: str | None = None,
        chunk: int = DEFAULT_CHUNK,
        heads: tuple[int, int, int, int] = PROBE_HEADS,
    ) -> None:
        """`heads`: (key heads, value heads, key dim, value dim) of the probe; the model's own, so that Triton compiles
        and tunes fla's kernels for them when the back end is made rather than in a user's first prompt."""
        kind = kind or os.environ.get(KERNEL_ENV, "auto")
        if kind not in KERNELS:
            raise InvalidRequestError(f"deltanet kernel must be one of {KERNELS}, got {kind!r}")
        self.chunk = chunk
        self.probe_errors: list[float] = []
        self._fla = None
        if kind != "torch" and device.type == "cuda":
            self._fla = _fla_function()
            if self._fla is not None and not self._probe(device, heads):
                self._fla = None
        if kind == "fla" and self._fla is None:
            raise InvalidRequestError(
                "deltanet kernel 'fla' needs flash-linear-attention importable on a CUDA device "
                "(and agreeing with the torch form)"
            )
        self.name = "fla" if self._fla is not None else "torch"

    def _probe(self, device: torch.device, heads: tuple[int, int, int, int]) -> bool:
        """Run both kernels on random inputs with a non-zero state; keep fla if they agree."""
        gen = torch.Generator(device=device).manual_seed(0)
        t, (hk, hv, dk, dv) = 200, heads
        q, k = (torch.randn(t, hk, dk, device=device, generator=gen) for _ in range(2))
        v = torch.randn(t, hv, dv, device=device, generator=gen)
        g = -torch.rand(t, hv, device=device, generator=gen) * 0.5
        beta = torch.rand(t, hv, device=device, generator=gen)
        state = torch.randn(hv, dk, dv, device=device, generator=gen) * 0.1
        try:
            want = self._run_torch(q, k, v, g, beta, state.clone())
            got = self._run_fla(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), state.clone())
        except Exception as e:
            log.warning("flash-linear-attention failed its probe (%s); prefill uses the torch delta rule", e)
            return False
        errors = [float((a.float() - b).norm() / b.norm()) for a, b in zip(got, want, strict=True)]
        self.probe_errors = errors
        if max(errors) > PROBE_TOLERANCE:
            log.warning(
                "flash-linear-attention disagrees with the torch delta rule (relative errors %s); not using it",
                errors,
            )
            return False
        return True

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
    ) -> torch.Tensor:
        """q, k `[T, Hk, dk]` (raw conv output), v `[T, Hv, dv]`, g fp32 `[T, Hv]`, beta `[T, Hv]`; `state`
        fp32 `[Hv, dk, dv]` is advanced in place. Returns the output `[T, Hv, dv]` in v's dtype."""
        if self._fla is not None:
            return self._run_fla(q, k, v, g, beta, state)[0]
        return self._run_torch(q, k, v, g, beta, state)[0].to(v.dtype)

    def _run_torch(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hv = v.shape[1]
        rep = hv // q.shape[1]
        # value head j reads key head j // rep; normalising before the expansion touches each key head once
        qf = l2_normalize(q.float()).repeat_interleave(rep, dim=1) * q.shape[-1] ** -0.5
        kf = l2_normalize(k.float()).repeat_interleave(rep, dim=1)
        out, final = chunk_gated_delta_rule_torch(
            qf.transpose(0, 1),
            kf.transpose(0, 1),
            v.float().transpose(0, 1),
            g.float().T,
            beta.float().T,
            state,
            self.chunk,
        )
        state.copy_(final)
        return out.transpose(0, 1), state

    def _run_fla(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._fla is not None
        out, final = self._fla(
            q[None],
            k[None],
            v[None],
            g=g.float()[None],
            beta=beta[None],
            initial_state=state[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        state.copy_(final[0])
        return out[0], state


def deltanet_prefill(
    layer: GatedDeltaNet,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent: torch.Tensor,
    kernel: DeltaRuleKernel,
    ops: Elementwise,
) -> torch.Tensor:
    """The mixer over `x [T, H]` (normed), continuing from and advancing `conv_state [C, kernel-1]` (model
    dtype: the last inputs of the conv) and `recurrent [Hv, dk, dv]` (fp32) in place, exactly the state that
    `GatedDeltaNet.step` and the megakernel continue from. Projections are the layer's own modules (so a
    quantized layer dequantizes one matrix at a time); the elementwise work is `ops`'."""
    q, k, v = ops.conv_silu(layer, layer.in_proj_qkv(x), conv_state)
    beta, g = ops.gates(layer, layer.in_proj_b(x), layer.in_proj_a(x))
    core = kernel(q, k, v, g, beta, recurrent).to(x.dtype)
    del q, k, v, beta, g
    z = layer.in_proj_z(x).reshape(*core.shape)
    normed = ops.gated_rms_norm(layer.norm, core, z)
    del z, core
    return layer.out_proj(normed.reshape(*x.shape[:-1], layer.value_dim))

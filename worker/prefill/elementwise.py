"""The prefill's elementwise work around the GEMMs: norms, the DeltaNet conv and gates, the gated norm, the
attention heads' norms, RoPE and output gate, SwiGLU.

Two forms compute the same values:
- "torch": the layers' own PyTorch code, on any device (row blocks where a piece's fp32 temporaries would be
  large).
- "triton": one kernel per operation (`triton_kernels.py`), on a CUDA device where Triton imports and agrees with
  the torch form on a probe at the model's shapes. Per DeltaNet layer of the 27B shapes the torch forms' fp32
  passes move 17.8 GB at an 8K-token piece (the kernels 1.8) and launch 58 kernels at a 256-token one (the
  kernels 7): `python -m tools.prefill_traffic`.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from ..errors import InvalidRequestError
from ..layers.attention import GatedAttention
from ..layers.deltanet import GatedDeltaNet
from ..layers.norms import GatedRMSNorm, ZeroCenteredRMSNorm

log = logging.getLogger(__name__)

FORMS = ("auto", "triton", "torch")
FORM_ENV = "ONESTREAM_PREFILL_ELEMENTWISE"  # pins the form: triton, torch or auto (the default)
# Tokens per block of the torch form's fp32 work (the conv's sums, the gated norm): each row's values are
# computed alone, so blocks give the same bits as one pass, and the fp32 temporaries stay a block's.
ROW_BLOCK_TOKENS = 1024
# The probe admits the kernels when every output is within this of the torch form's, relative to the output's
# largest magnitude: two roundings to bf16 (2^-8 each) and an fp32 sum in another order; a kernel that reads
# the wrong element is off by O(1).
PROBE_TOLERANCE = 1 / 64
PROBE_TOKENS = 37  # not a multiple of any block size, and more than the conv's span


class TorchElementwise:
    """The layers' own PyTorch forms."""

    name = "torch"

    def rms_norm(self, norm: ZeroCenteredRMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def silu_mul_(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate <- silu(gate) * up, as SwiGLU computes it without autograd."""
        return F.silu(gate, inplace=True).mul_(up)

    def gates(
        self, layer: GatedDeltaNet, b: torch.Tensor, a: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(beta, g) of the delta rule from the projections b and a `[T, Hv]`."""
        return layer._gate_values(b, a)

    def conv_silu(
        self, layer: GatedDeltaNet, x: torch.Tensor, conv_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """silu(causal depthwise conv) over the projected piece `x [T, C]`, continuing from and advancing
        `conv_state [C, kernel - 1]` in place (the last inputs of the conv); split into q, k `[T, Hk, dk]` and
        v `[T, Hv, dv]`."""
        t = x.shape[0]
        span = layer.kernel - 1
        window = torch.cat((conv_state.T, x))  # [span + T, C]: time-major, no transposes
        weight = layer.conv1d.weight[
            :, 0, :
        ].float()  # [C, kernel]; column `span` multiplies the current input
        mixed = torch.empty_like(x)
        for r0 in range(0, t, ROW_BLOCK_TOKENS):
            r1 = min(t, r0 + ROW_BLOCK_TOKENS)
            conv = window[span + r0 : span + r1].float() * weight[:, span]
            for j in range(span):
                conv += window[j + r0 : j + r1].float() * weight[:, j]
            mixed[r0:r1] = F.silu(conv)
        conv_state.copy_(window[t:].T)
        return layer._split(mixed)

    def attention_heads(
        self,
        layer: GatedAttention,
        qg: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections `[1, T, *]` -> q `[1, nH, T, D]` and k (normed, rotated), v, and the output gate in
        the form `attention_gate` takes."""
        return layer._heads(qg, k, v, cos, sin)

    def attention_gate(self, layer: GatedAttention, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """attn `[1, nH, T, D]` * sigmoid(gate) -> `[1, T, nH*D]`, o_proj's input."""
        return layer._gated(attn, gate)

    def gated_rms_norm(self, norm: GatedRMSNorm, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = torch.empty_like(core)
        for r0 in range(0, core.shape[0], ROW_BLOCK_TOKENS):
            r1 = r0 + ROW_BLOCK_TOKENS
            normed[r0:r1] = norm(core[r0:r1], z[r0:r1])
        return normed


class TritonElementwise:
    """One Triton kernel per operation (triton_kernels.py)."""

    name = "triton"

    def __init__(self) -> None:
        from . import triton_kernels

        self._k = triton_kernels
        self._torch = TorchElementwise()  # for shapes outside the kernels' bounds (never Qwen3.5's)

    def rms_norm(self, norm: ZeroCenteredRMSNorm, x: torch.Tensor) -> torch.Tensor:
        return self._k.rms_norm(x.contiguous(), norm.weight, norm.eps)

    def silu_mul_(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not self._k.silu_mul_fits(gate.numel()):
            return self._torch.silu_mul_(gate, up)
        if not gate.is_contiguous():
            return gate.copy_(self._k.silu_mul_(gate.contiguous(), up.contiguous()))
        return self._k.silu_mul_(gate, up.contiguous())

    def gates(
        self, layer: GatedDeltaNet, b: torch.Tensor, a: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k.gates(b.contiguous(), a.contiguous(), layer.A_log, layer.dt_bias)

    def conv_silu(
        self, layer: GatedDeltaNet, x: torch.Tensor, conv_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._k.conv_fits(layer.key_dim, layer.kernel):
            return self._torch.conv_silu(layer, x, conv_state)
        x = x.contiguous()
        span, t = layer.kernel - 1, x.shape[0]
        q, k, v = self._k.conv_silu(x, conv_state, layer.conv1d.weight[:, 0, :], layer.key_dim)
        if t >= span:
            conv_state.copy_(x[-span:].T)
        else:  # a piece shorter than the window keeps some of the old inputs
            conv_state.copy_(torch.cat((conv_state.T, x))[-span:].T)
        shape = (t, layer.num_k_heads, layer.head_k_dim)
        return q.view(shape), k.view(shape), v.view(t, layer.num_v_heads, layer.head_v_dim)

    def gated_rms_norm(self, norm: GatedRMSNorm, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self._k.gated_rms_norm(core.contiguous(), z.contiguous(), norm.weight, norm.eps)

    def attention_heads(
        self,
        layer: GatedAttention,
        qg: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._k.heads_fit(layer.head_dim):
            return self._torch.attention_heads(layer, qg, k, v, cos, sin)
        (_, t, _), d = qg.shape, layer.head_dim
        heads = qg.view(t, layer.num_heads, 2 * d)
        if not self._k.rotary_fits(
            cos.shape[-1]
        ):  # the torch form's heads; the gate still goes to the kernel
            q, k, v, _ = self._torch.attention_heads(layer, qg, k, v, cos, sin)
            return q, k, v, heads[..., d:]
        q = self._k.head_norm_rope(heads[..., :d], layer.q_norm.weight, layer.q_norm.eps, cos, sin)
        keys = k.view(t, layer.num_kv_heads, d)
        k = self._k.head_norm_rope(keys, layer.k_norm.weight, layer.k_norm.eps, cos, sin)
        v = v.view(1, t, layer.num_kv_heads, d).transpose(1, 2)
        return q[None], k[None], v, heads[..., d:]  # the gate stays a view of the projection

    def attention_gate(self, layer: GatedAttention, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if not self._k.heads_fit(layer.head_dim):
            return self._torch.attention_gate(layer, attn, gate)
        return self._k.gated_heads(attn[0], gate)[None]


Elementwise = TorchElementwise | TritonElementwise


def elementwise_for(
    device: torch.device,
    norm: ZeroCenteredRMSNorm,
    layer: GatedDeltaNet | None,
    attention: GatedAttention | None,
    form: str | None = None,
) -> Elementwise:
    """The form a prefill on `device` uses: `form` (else $ONESTREAM_PREFILL_ELEMENTWISE, else auto). Auto takes
    the kernels on a CUDA device where they import and pass the probe on the model's own shapes and weights
    (`norm`, a hidden-size norm; `layer` and `attention`, a DeltaNet and an attention mixer where the model has
    them), which also compiles them before any prompt does."""
    form = form or os.environ.get(FORM_ENV, "auto")
    if form not in FORMS:
        raise InvalidRequestError(f"elementwise form must be one of {FORMS}, got {form!r}")
    if form == "torch" or device.type != "cuda":
        if form == "triton":
            raise InvalidRequestError("the elementwise form 'triton' needs a CUDA device")
        return TorchElementwise()
    try:
        kernels = TritonElementwise()
        errors = probe(kernels, device, norm, layer, attention)
    except Exception as e:  # absent, or present but broken (a Triton it cannot use): the torch form runs
        if form == "triton":
            raise InvalidRequestError(f"the elementwise kernels failed their probe: {e}") from e
        log.warning("the prefill's elementwise kernels failed their probe (%s); using the torch forms", e)
        return TorchElementwise()
    if max(errors.values()) > PROBE_TOLERANCE:
        if form == "triton":
            raise InvalidRequestError(f"the elementwise kernels disagree with the torch forms: {errors}")
        log.warning(
            "the prefill's elementwise kernels disagree with the torch forms (%s); not using them", errors
        )
        return TorchElementwise()
    return kernels


@torch.inference_mode()
def probe(
    kernels: Elementwise,
    device: torch.device,
    norm: ZeroCenteredRMSNorm,
    layer: GatedDeltaNet | None,
    attention: GatedAttention | None = None,
    tokens: int = PROBE_TOKENS,
) -> dict[str, float]:
    """Each operation of `kernels` against the torch form on random inputs with the given modules' weights:
    the largest difference relative to the output's largest magnitude, by operation."""
    reference = TorchElementwise()
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = norm.weight.dtype

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * 2).to(dtype)

    hidden = randn(tokens, norm.weight.shape[0])
    gate, up = randn(tokens, 3 * norm.weight.shape[0]), randn(tokens, 3 * norm.weight.shape[0])
    pairs = {
        "rms_norm": (kernels.rms_norm(norm, hidden), reference.rms_norm(norm, hidden)),
        "silu_mul": (kernels.silu_mul_(gate.clone(), up), reference.silu_mul_(gate.clone(), up)),
    }
    if layer is not None:
        heads, dv = layer.num_v_heads, layer.head_v_dim
        b, a = randn(tokens, heads), randn(tokens, heads) * 8  # past softplus's threshold now and then
        (beta, g), (want_beta, want_g) = kernels.gates(layer, b, a), reference.gates(layer, b, a)
        pairs["beta"], pairs["g"] = (beta, want_beta), (g, want_g)
        x, state = randn(tokens, layer.conv_dim), randn(layer.conv_dim, layer.kernel - 1)
        ours, theirs = state.clone(), state.clone()
        short = x[: max(1, layer.kernel - 2)]  # shorter than the window: some old inputs stay in the state
        for piece, name in ((x, "conv"), (short, "conv_short")):
            got_qkv, want_qkv = (
                kernels.conv_silu(layer, piece, ours),
                reference.conv_silu(layer, piece, theirs),
            )
            for part, got_part, want_part in zip("qkv", got_qkv, want_qkv, strict=True):
                pairs[f"{name}_{part}"] = (got_part, want_part)
        pairs["conv_state"] = (ours, theirs)
        core, z = randn(tokens, heads, dv), randn(tokens, heads, dv)
        pairs["gated_rms_norm"] = (
            kernels.gated_rms_norm(layer.norm, core, z),
            reference.gated_rms_norm(layer.norm, core, z),
        )
    if attention is not None:
        heads, kv_heads, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
        qg, k, v = (
            randn(1, tokens, 2 * heads * d),
            randn(1, tokens, kv_heads * d),
            randn(1, tokens, kv_heads * d),
        )
        angles = (
            torch.rand(tokens, 2 * (d // 8), device=device, generator=gen) * 6.3
        )  # a quarter of D rotates
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        got, want = (
            kernels.attention_heads(attention, qg, k, v, cos, sin),
            reference.attention_heads(attention, qg, k, v, cos, sin),
        )
        pairs["q_norm_rope"], pairs["k_norm_rope"], pairs["v"] = (
            (got[0], want[0]),
            (got[1], want[1]),
            (got[2], want[2]),
        )
        attn = randn(1, heads, tokens, d)
        pairs["attention_gate"] = (
            kernels.attention_gate(attention, attn, got[3]),
            reference.attention_gate(attention, attn, want[3]),
        )
    return {name: relative_error(got, want) for name, (got, want) in pairs.items()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| over the largest |want|; inf on a dtype or shape mismatch or a non-finite value."""
    if got.dtype != want.dtype:
        return float("inf")
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape or not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)

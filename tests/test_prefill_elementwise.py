"""The prefill's elementwise kernels (worker/prefill/triton_kernels.py) against the torch forms they replace
(worker/prefill/elementwise.py), on fresh random inputs, and the probe that admits them.

On a machine without a GPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET):
the same source the GPU compiles. The interpreter rounds fp32 to bf16 by truncation where the GPU rounds to
nearest even, so these tests give it the GPU's rounding (`gpu_rounding`), and check the kernels' arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onestream.kernels.random_model import config_27b
from onestream.worker.errors import InvalidRequestError
from onestream.worker.layers.attention import GatedAttention
from onestream.worker.layers.deltanet import GatedDeltaNet
from onestream.worker.layers.norms import ZeroCenteredRMSNorm
from onestream.worker.prefill import FastPrefill
from onestream.worker.prefill.elementwise import (
    PROBE_TOLERANCE,
    TorchElementwise,
    TritonElementwise,
    elementwise_for,
    probe,
    relative_error,
)
from onestream.worker.testing import tiny_config

from .test_prefill import build_model, kld, tokens

triton = pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("the GPU runs these kernels compiled: tests/test_prefill_gpu.py", allow_module_level=True)

TORCH, TRITON = TorchElementwise(), TritonElementwise()
# One rounding to bf16 (2^-8 relative) of an output whose fp32 value may differ in its last bits (a sum in another
# order, another exp), and two for the gated norm and SwiGLU, which round an intermediate too.
ONE_ROUNDING, TWO_ROUNDINGS = 2**-7, 2**-6


@pytest.fixture(autouse=True)
def gpu_rounding(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The interpreter's fp32 -> bf16 conversion rounded to nearest even, as the GPU's `cvt.rn.bf16.f32`."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, src, dst, rounding):  # type: ignore[no-untyped-def]
        if src == tl.float32 and dst == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16)
        return original(data, src, dst, rounding)

    monkeypatch.setattr(interpreter, "_convert_float", convert)
    yield


def randn(*shape: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def mixer(seed: int = 1, **overrides: object) -> GatedDeltaNet:
    """A DeltaNet layer with random weights in bf16 (its conv weights and gate parameters are what the
    kernels read)."""
    cfg = tiny_config(**overrides)
    layer = GatedDeltaNet(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layer.bfloat16()


def norm_with_random_weight(width: int, seed: int) -> ZeroCenteredRMSNorm:
    norm = ZeroCenteredRMSNorm(width)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(seed)) * 0.3)
    return norm.bfloat16()


@pytest.mark.parametrize("width, rows", [(64, 5), (320, 37), (5120, 3)])
def test_rms_norm(width: int, rows: int) -> None:
    norm = norm_with_random_weight(width, seed=width)
    x = randn(rows, width, seed=rows)
    assert relative_error(TRITON.rms_norm(norm, x), TORCH.rms_norm(norm, x)) <= ONE_ROUNDING


def test_rms_norm_of_a_strided_view() -> None:
    norm = norm_with_random_weight(96, seed=2)
    x = randn(96, 11, seed=3).T  # not contiguous: the kernel gets a copy
    assert relative_error(TRITON.rms_norm(norm, x), TORCH.rms_norm(norm, x)) <= ONE_ROUNDING


@pytest.mark.parametrize("shape", [(3, 7), (37, 1000), (2, 3, 129)])
def test_silu_mul(shape: tuple[int, ...]) -> None:
    gate, up = randn(*shape, seed=5), randn(*shape, seed=6)
    got = TRITON.silu_mul_(gate.clone(), up)
    assert relative_error(got, TORCH.silu_mul_(gate.clone(), up)) <= TWO_ROUNDINGS


def test_silu_mul_writes_a_strided_gate_in_place() -> None:
    gate, up = randn(12, 40, seed=7), randn(40, 12, seed=8).T
    view = gate.T.clone().T  # same values, column-major
    out = TRITON.silu_mul_(view, up.contiguous())
    assert out is view
    assert relative_error(view, TORCH.silu_mul_(gate.clone(), up.contiguous())) <= TWO_ROUNDINGS


@pytest.mark.parametrize("tokens_", [1, 2, 3, 4, 45, 100])
def test_conv_silu_continues_and_advances_the_state(tokens_: int) -> None:
    layer = mixer()
    x = randn(tokens_, layer.conv_dim, seed=tokens_)
    state = randn(layer.conv_dim, layer.kernel - 1, seed=99)
    ours, theirs = state.clone(), state.clone()
    got, want = TRITON.conv_silu(layer, x, ours), TORCH.conv_silu(layer, x, theirs)
    for part, a, b in zip("qkv", got, want, strict=True):
        assert a.shape == b.shape and a.is_contiguous(), part  # apart: the delta rule copies nothing
        assert relative_error(a, b) <= ONE_ROUNDING, part
    assert torch.equal(ours, theirs)  # the state is a copy of inputs: exact


def test_conv_silu_pieces_equal_one_piece() -> None:
    layer = mixer()
    x = randn(50, layer.conv_dim, seed=11)
    whole = torch.zeros(layer.conv_dim, layer.kernel - 1, dtype=torch.bfloat16)
    pieces = whole.clone()
    one = TRITON.conv_silu(layer, x, whole)
    parts = [TRITON.conv_silu(layer, x[a:b], pieces) for a, b in ((0, 2), (2, 31), (31, 50))]
    for i in range(3):  # q, k, v
        assert torch.equal(one[i], torch.cat([p[i] for p in parts]))
    assert torch.equal(whole, pieces)


def test_gates() -> None:
    layer = mixer()
    heads = layer.num_v_heads
    b, a = randn(41, heads, seed=12), randn(41, heads, seed=13, scale=16.0)  # a passes softplus's threshold
    (beta, g), (want_beta, want_g) = TRITON.gates(layer, b, a), TORCH.gates(layer, b, a)
    assert beta.dtype == want_beta.dtype and g.dtype == torch.float32
    assert relative_error(beta, want_beta) <= ONE_ROUNDING
    assert relative_error(g, want_g) <= 1e-5  # fp32 throughout


def test_gated_rms_norm() -> None:
    layer = mixer()
    core = randn(23, layer.num_v_heads, layer.head_v_dim, seed=14)
    z = randn(23, layer.num_v_heads, layer.head_v_dim, seed=15)
    got = TRITON.gated_rms_norm(layer.norm, core, z)
    assert relative_error(got, TORCH.gated_rms_norm(layer.norm, core, z)) <= TWO_ROUNDINGS


def test_the_probe_admits_the_kernels_and_catches_a_wrong_one() -> None:
    layer, norm, attention = mixer(), norm_with_random_weight(64, seed=16), heads_layer()
    errors = probe(TRITON, torch.device("cpu"), norm, layer, attention)
    assert set(errors) >= {
        "rms_norm",
        "silu_mul",
        "beta",
        "g",
        "conv_q",
        "conv_v",
        "conv_state",
        "gated_rms_norm",
    }
    assert set(errors) >= {"q_norm_rope", "k_norm_rope", "attention_gate"}
    assert max(errors.values()) <= PROBE_TOLERANCE, errors

    class ShiftedConv(TritonElementwise):
        def conv_silu(self, layer, x, conv_state):  # type: ignore[no-untyped-def]
            return tuple(
                part.roll(1, dims=0) for part in super().conv_silu(layer, x, conv_state)
            )  # a token late

    errors = probe(ShiftedConv(), torch.device("cpu"), norm, layer)
    assert errors["conv_v"] > PROBE_TOLERANCE and errors["rms_norm"] <= PROBE_TOLERANCE


def test_the_probe_admits_the_kernels_at_the_27b_shapes() -> None:
    """The probe a card runs before its first prompt, at the 27B shapes (5,120-wide norms, 17,408-wide SwiGLU
    rows, 48 value heads, a 10,240-channel conv, 24 attention heads of 256 dims with a quarter rotated): every
    kernel's blocks, bounds and strides at the sizes a GPU card meets, not only the tiny model's."""
    cfg = config_27b(1)
    gen = torch.Generator().manual_seed(27)
    layer, attention, norm = GatedDeltaNet(cfg), GatedAttention(cfg), ZeroCenteredRMSNorm(cfg.hidden_size)
    with torch.no_grad():
        for module in (layer, attention, norm):
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    errors = probe(TRITON, torch.device("cpu"), norm.bfloat16(), layer.bfloat16(), attention.bfloat16())
    assert {"conv_q", "conv_k", "conv_v", "gated_rms_norm", "q_norm_rope", "attention_gate"} <= set(errors)
    assert max(errors.values()) <= PROBE_TOLERANCE, errors


def heads_layer(seed: int = 21, **overrides: object) -> GatedAttention:
    """An attention layer with random weights in bf16 (its q and k norms are what the kernels read)."""
    layer = GatedAttention(tiny_config(**overrides))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer.bfloat16()


def rotary_tables(tokens_: int, rot: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(start, start + tokens_)[:, None] * (10000.0 ** (-torch.arange(0, rot, 2) / rot))
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().bfloat16(), angles.sin().bfloat16()


@pytest.mark.parametrize("tokens_, start", [(1, 0), (19, 0), (64, 1000)])
def test_attention_heads_norm_and_rotate_like_the_layer(tokens_: int, start: int) -> None:
    layer = heads_layer()
    d = layer.head_dim
    qg = randn(1, tokens_, 2 * layer.num_heads * d, seed=22)
    k, v = (
        randn(1, tokens_, layer.num_kv_heads * d, seed=23),
        randn(1, tokens_, layer.num_kv_heads * d, seed=24),
    )
    cos, sin = rotary_tables(tokens_, d // 4, start)
    got, want = (
        TRITON.attention_heads(layer, qg, k, v, cos, sin),
        TORCH.attention_heads(layer, qg, k, v, cos, sin),
    )
    for name, a, b in zip(("q", "k", "v"), got[:3], want[:3], strict=True):
        assert a.shape == b.shape, name
        assert relative_error(a, b) <= TWO_ROUNDINGS, name
    attn = randn(1, layer.num_heads, tokens_, d, seed=25)
    gated = TRITON.attention_gate(layer, attn, got[3])
    assert relative_error(gated, TORCH.attention_gate(layer, attn, want[3])) <= TWO_ROUNDINGS


def test_attention_heads_of_an_odd_width_take_the_torch_form() -> None:
    layer = heads_layer(head_dim=24)
    qg, k = randn(1, 5, 2 * layer.num_heads * 24, seed=26), randn(1, 5, layer.num_kv_heads * 24, seed=27)
    cos, sin = rotary_tables(5, 6)
    got, want = (
        TRITON.attention_heads(layer, qg, k, k, cos, sin),
        TORCH.attention_heads(layer, qg, k, k, cos, sin),
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_rotary_width_the_kernel_does_not_take_keeps_the_torch_heads_and_the_kernels_gate() -> None:
    layer = heads_layer()
    d = layer.head_dim
    qg = randn(1, 7, 2 * layer.num_heads * d, seed=28)
    k, v = randn(1, 7, layer.num_kv_heads * d, seed=29), randn(1, 7, layer.num_kv_heads * d, seed=30)
    cos, sin = rotary_tables(7, 12)  # halves of 6
    got, want = (
        TRITON.attention_heads(layer, qg, k, v, cos, sin),
        TORCH.attention_heads(layer, qg, k, v, cos, sin),
    )
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    attn = randn(1, layer.num_heads, 7, d, seed=31)
    gated = TRITON.attention_gate(layer, attn, got[3])
    assert relative_error(gated, TORCH.attention_gate(layer, attn, want[3])) <= TWO_ROUNDINGS


def test_the_form_is_chosen_by_device_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, norm, cpu = mixer(), norm_with_random_weight(64, seed=17), torch.device("cpu")
    attention = heads_layer()
    assert elementwise_for(cpu, norm, layer, attention).name == "torch"  # the kernels compile for CUDA only
    with pytest.raises(InvalidRequestError, match="needs a CUDA device"):
        elementwise_for(cpu, norm, layer, attention, "triton")
    with pytest.raises(InvalidRequestError, match="must be one of"):
        elementwise_for(cpu, norm, layer, attention, "fused")
    monkeypatch.setenv("ONESTREAM_PREFILL_ELEMENTWISE", "cuda")
    with pytest.raises(InvalidRequestError, match="must be one of"):
        elementwise_for(cpu, norm, layer, attention)


def test_a_prefill_with_the_kernels_agrees_with_the_torch_forms() -> None:
    """The whole fast prefill of a bf16 model with the kernels in place of the torch forms: the same states
    to a rounding, and next-token distributions within a small KLD."""
    model = build_model(seed=5).to(torch.bfloat16)
    ids = tokens(model, 70, seed=6)
    results = []
    for form in (TORCH, TRITON):
        fast = FastPrefill(model, elementwise="torch")
        fast.elementwise = form
        state = model.new_state(128)
        with torch.inference_mode():
            out = fast(ids, state)
            nxt = fast(ids[:9], state)  # a second piece continues the conv windows and recurrent states
        results.append((out, nxt, state))
    (out_t, nxt_t, state_t), (out_k, nxt_k, state_k) = results
    for a, b in ((out_t.logits, out_k.logits), (nxt_t.logits, nxt_k.logits)):
        assert float(kld(a.float(), b.float()).max()) < 1e-3
    assert state_t.conv.keys() == state_k.conv.keys() and state_t.conv
    for i, conv in state_t.conv.items():
        assert (
            relative_error(state_k.conv[i], conv) <= 2**-6
        )  # the last inputs: the layer's roundings compound
        assert relative_error(state_k.recurrent[i], state_t.recurrent[i]) < 0.05


def test_the_torch_form_is_the_layers_own() -> None:
    """The torch form's gates and SwiGLU product are the modules' (bit for bit)."""
    layer = mixer()
    x = randn(9, layer.in_proj_b.in_features, seed=18)
    with torch.no_grad():
        want = layer._gates(x)
        got = TORCH.gates(layer, layer.in_proj_b(x), layer.in_proj_a(x))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    gate, up = randn(4, 30, seed=19), randn(4, 30, seed=20)
    assert torch.equal(TORCH.silu_mul_(gate.clone(), up), F.silu(gate) * up)

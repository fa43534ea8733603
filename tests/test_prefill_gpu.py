"""The fast prefill path on the GPU against the reference model (skipped without CUDA).

A 27B-shaped model with 4 layers (3 DeltaNet + 1 attention, the full vocabulary), fresh random bf16 weights,
and its fp32 copy as the ground truth. Checked: each delta-rule kernel the machine offers (the torch form,
flash-linear-attention's where it imports) with each form of the elementwise work (Triton kernels, torch),
each fused SDPA kernel on the attention shapes (head_dim 256, GQA, continuing from a cache), decode after
the fast prefill against the fp32 reference (KLD and greedy tokens), pieces against one shot, and the
megakernel continuing from the state the fast prefill leaves.
Quantized weights (q4_k_m's random blocks): the Triton dequantizer against the torch codec, and the fast
prefill dequantizing into its scratch against the fp32 reference on the same blocks.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")]

if HAS_GPU:
    from onestream.kernels.random_model import config_27b, random_model
    from onestream.kernels.random_quant import preset_types, quantize_randomly, random_blocks
    from onestream.worker.prefill import DeltaRuleKernel, FastPrefill, causal_attention
    from onestream.worker.prefill.deltanet import _fla_function
    from onestream.worker.prefill.elementwise import PROBE_TOLERANCE, probe
    from onestream.worker.quant import QuantType, dequantize, triton_dequant
    from onestream.worker.quant.scratch import PROBE_ABSOLUTE, PROBE_RELATIVE

KLD_BAR = 1e-3  # nats: decode after the fast prefill against the fp32 reference
TIE_MARGIN = 0.05  # top-2 logit gap (bf16 logits) under which a greedy choice is a tie
PROMPT = 3000  # crosses many delta-rule chunks and, in pieces of 1024, two piece boundaries


def kld(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    p = reference.float().log_softmax(-1)
    return (p.exp() * (p - other.float().log_softmax(-1))).sum(-1)


@pytest.fixture(scope="module")
def models():
    model = random_model(config_27b(4), seed=2024)
    fp32 = copy.deepcopy(model).float()
    yield model, fp32
    del model, fp32
    torch.cuda.empty_cache()


def prompt(model, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n,), device="cuda", generator=gen)


def kernels() -> list[str]:
    return ["torch", "fla"] if _fla_function() is not None else ["torch"]


def greedy_rows(model, state, first: torch.Tensor, n: int, forced: list[int] | None = None):
    """Logits of n reference decode steps from `first`; the tokens fed are `forced` (teacher forcing, so two
    runs stay comparable row by row) or the greedy ones."""
    rows, logits, fed = [], first, []
    with torch.inference_mode():
        for i in range(n):
            rows.append(logits[-1].float())
            token = forced[i] if forced is not None else int(logits[-1].argmax())
            fed.append(token)
            logits = model.forward_step(torch.tensor([token], device="cuda"), state).logits
    return torch.stack(rows), fed


@pytest.mark.parametrize("kernel", ["torch", "fla"])
def test_delta_rule_kernels_agree_with_the_fp32_recurrence_form(kernel: str) -> None:
    if kernel not in kernels():
        pytest.skip("flash-linear-attention is not importable here")
    gen = torch.Generator(device="cuda").manual_seed(1)
    t, hk, hv, d = 1500, 16, 48, 128  # the 27B heads
    q, k = (torch.randn(t, hk, d, device="cuda", generator=gen) for _ in range(2))
    v = torch.randn(t, hv, d, device="cuda", generator=gen)
    g = -torch.rand(t, hv, device="cuda", generator=gen)
    beta = torch.rand(t, hv, device="cuda", generator=gen)
    state = torch.randn(hv, d, d, device="cuda", generator=gen) * 0.1
    want_state = state.clone()
    want = DeltaRuleKernel(torch.device("cuda"), "torch")(q, k, v, g, beta, want_state)
    got_state = state.clone()
    bf = torch.bfloat16
    got = DeltaRuleKernel(torch.device("cuda"), kernel)(
        q.to(bf), k.to(bf), v.to(bf), g, beta.to(bf), got_state
    )
    out_err = float((got.float() - want).norm() / want.norm())
    state_err = float((got_state - want_state).norm() / want_state.norm())
    print(f"\n[{kernel}] bf16 inputs vs fp32 torch form: output {out_err:.2e}, state {state_err:.2e}")
    assert out_err < 2e-2 and state_err < 2e-2


@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
@pytest.mark.parametrize("start", [0, 1500])
def test_fused_sdpa_kernels_on_the_attention_shapes(backend: str, start: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    t, nh, nkv, d = 1024, 24, 4, 256
    q = torch.randn(1, nh, t, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    keys, values = (
        torch.randn(1, nkv, start + t, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(2)
    )
    want = causal_attention(q.float(), keys.float(), values.float(), d**-0.5, "math")
    try:
        got = causal_attention(q, keys, values, d**-0.5, backend)
    except RuntimeError as e:
        pytest.skip(f"SDPA {backend} cannot run these shapes here: {str(e).splitlines()[0]}")
    err = float((got.float() - want).norm() / want.norm())
    print(f"\n[sdpa {backend}, start {start}] relative error vs fp32 math {err:.2e}")
    assert err < 1e-2


@pytest.mark.parametrize("elementwise", ["triton", "torch"])
@pytest.mark.parametrize("kernel", ["torch", "fla"])
def test_decode_after_fast_prefill_against_the_fp32_reference(models, kernel: str, elementwise: str) -> None:
    if kernel not in kernels():
        pytest.skip("flash-linear-attention is not importable here")
    model, fp32 = models
    ids = prompt(model, PROMPT, seed=3)
    with torch.inference_mode():
        ref_state = fp32.new_state(PROMPT + 64)
        first = fp32.forward_step(ids, ref_state, logits="last").logits
        want, fed = greedy_rows(fp32, ref_state, first, 16)
        bf_state = model.new_state(PROMPT + 64)
        bf_first = model.forward_step(ids, bf_state, logits="last").logits
        bf_rows, _ = greedy_rows(model, bf_state, bf_first, 16, forced=fed)
        fast_state = model.new_state(PROMPT + 64)
        fast = FastPrefill(model, deltanet=kernel, elementwise=elementwise)
        assert fast.delta_rule.name == kernel and fast.elementwise.name == elementwise
        fast_first = fast(ids, fast_state).logits
        got, _ = greedy_rows(model, fast_state, fast_first, 16, forced=fed)
    fast_kld, bf_kld = kld(want, got), kld(want, bf_rows)
    print(
        f"\n[{kernel}, elementwise {elementwise}] KLD vs fp32 reference: fast prefill mean {fast_kld.mean():.2e} max {fast_kld.max():.2e}; "
        f"bf16 reference prefill mean {bf_kld.mean():.2e} max {bf_kld.max():.2e}"
    )
    # bf16 weights alone cost some KLD: the fast path must stay within the bar or within the bf16
    # reference's own distance from fp32
    assert float(fast_kld.mean()) <= max(KLD_BAR, 1.25 * float(bf_kld.mean()))
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= TIE_MARGIN
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_the_elementwise_kernels_pass_their_probe_at_the_27b_shapes(models) -> None:
    """On a GPU the prefill takes the Triton kernels by default; each agrees with its torch form at the model's
    shapes well inside the probe's bound (two bf16 roundings)."""
    model, _ = models
    fast = FastPrefill(model)
    assert fast.elementwise.name == "triton"
    layers = model.model.layers
    mixer = next(layer.linear_attn for layer in layers if not layer.is_full_attention)
    attention = next(layer.self_attn for layer in layers if layer.is_full_attention)
    errors = probe(fast.elementwise, model.device, layers[0].input_layernorm, mixer, attention, tokens=1000)
    assert {"conv_q", "conv_k", "conv_v", "gated_rms_norm", "q_norm_rope", "attention_gate"} <= set(errors)
    print(f"\nelementwise kernels against the torch forms: {errors}")
    assert max(errors.values()) <= PROBE_TOLERANCE


def test_pieces_equal_one_shot_on_the_gpu(models) -> None:
    model, _ = models
    ids = prompt(model, PROMPT, seed=4)
    fast = FastPrefill(model)
    with torch.inference_mode():
        one = fast(ids, model.new_state(PROMPT))
        state = model.new_state(PROMPT)
        for a in range(0, PROMPT, 1024):
            last = fast(ids[a : a + 1024], state)
    value = kld(one.logits, last.logits)
    print(f"\npieces of 1024 vs one shot: KLD {float(value.max()):.2e}")
    assert float(value.max()) <= KLD_BAR
    assert torch.equal(one.logits.argmax(-1), last.logits.argmax(-1))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_triton_dequantizer_equals_the_codec(qtype: str) -> None:
    if not triton_dequant.importable():
        pytest.skip("triton is not importable here")
    kind = QuantType[qtype]
    gen = torch.Generator(device="cuda").manual_seed(6)
    shape = (17408, 5120)  # the MLP's, 89 M weights: the grid and the addresses of a real matrix
    raw = random_blocks(kind, shape, generator=gen, device="cuda")
    want = dequantize(kind, raw, shape, torch.float32)
    got32 = triton_dequant.dequantize_into(kind, raw, torch.empty(shape, device="cuda"))
    got16 = triton_dequant.dequantize_into(kind, raw, torch.empty(shape, device="cuda", dtype=torch.bfloat16))
    exact32 = float((got32 == want).float().mean())
    exact16 = float((got16 == want.bfloat16()).float().mean())
    print(f"\n[{qtype}] Triton vs codec: fp32 identical {exact32:.6f}, bf16 identical {exact16:.6f}")
    bound = PROBE_RELATIVE * want.abs() + PROBE_ABSOLUTE * float(want.abs().max())
    assert bool(((got16.float() - want).abs() <= bound).all())
    assert bool(((got32 - want).abs() <= 2.0**-20 * float(want.abs().max())).all())


@pytest.fixture(scope="module")
def quantized_models():
    model = random_model(config_27b(4), seed=77)
    quantize_randomly(model, preset_types(model, "q4_k_m"), seed=78)
    fp32 = copy.deepcopy(model).float()
    yield model, fp32
    del model, fp32
    torch.cuda.empty_cache()


def test_quantized_fast_prefill_against_the_fp32_reference(quantized_models) -> None:
    """q4_k_m blocks: the fast prefill (each matrix dequantized into the scratch by the Triton kernels, then
    the codec) against the fp32 reference on the same blocks, and the bf16 reference's own distance."""
    model, fp32 = quantized_models
    ids = prompt(model, PROMPT, seed=9)
    # the torch delta rule: the distance from fp32 here is the dequantizer's and the GEMMs', not fla's
    fast = FastPrefill(model, deltanet="torch")
    codec = FastPrefill(model, deltanet="torch", dequant="torch")
    assert fast.scratch is not None and codec.scratch is not None
    with torch.inference_mode():
        ref_state = fp32.new_state(PROMPT + 16)
        want, fed = greedy_rows(fp32, ref_state, fp32.forward_step(ids, ref_state, logits="last").logits, 8)
        bf_state = model.new_state(PROMPT + 16)
        bf_rows, _ = greedy_rows(
            model, bf_state, model.forward_step(ids, bf_state, logits="last").logits, 8, fed
        )
        fast_state = model.new_state(PROMPT + 16)
        got, _ = greedy_rows(model, fast_state, fast(ids, fast_state).logits, 8, fed)
        codec_state = model.new_state(PROMPT + 16)
        by_codec, _ = greedy_rows(model, codec_state, codec(ids, codec_state).logits, 8, fed)
    fast_kld, bf_kld, between = kld(want, got), kld(want, bf_rows), kld(by_codec, got)
    print(
        f"\n[q4_k_m] {fast.description}; probe {fast.scratch.probe_errors}\n"
        f"KLD vs fp32 reference: fast prefill mean {fast_kld.mean():.2e} max {fast_kld.max():.2e}; bf16 "
        f"reference prefill mean {bf_kld.mean():.2e}; Triton vs codec dequantizer {between.max():.2e}"
    )
    if triton_dequant.importable():
        assert fast.scratch.triton_types.get(QuantType.Q4_K) and fast.scratch.triton_types.get(QuantType.Q6_K)
    assert float(between.max()) <= KLD_BAR
    assert float(fast_kld.mean()) <= max(KLD_BAR, 1.25 * float(bf_kld.mean()))
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= TIE_MARGIN
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="the megakernel needs cupy")
def test_megakernel_continues_from_the_fast_prefill(models) -> None:
    # Random bf16 weights with peaked logits put even two valid bf16 implementations about 1e-3 nats apart
    # per layer; the scale is the megakernel decoding after the reference's own bf16 prefill.
    from onestream.kernels.backend import MegakernelBackend

    model, fp32 = models
    ids = prompt(model, PROMPT, seed=5)
    backend = MegakernelBackend(model)
    assert backend.fast_prefill is not None and backend.prefill_tokens >= 1024
    with torch.inference_mode():
        truth_state = fp32.new_state(PROMPT + 64)
        want, fed = greedy_rows(
            fp32, truth_state, fp32.forward_step(ids, truth_state, logits="last").logits, 12
        )
        runs = {}
        for label, prefill in (
            ("reference", lambda s: model.forward_step(ids, s, logits="last")),
            ("fast", None),
        ):
            state = backend.new_state(PROMPT + 64)
            out = backend.prefill(ids, state) if prefill is None else prefill(state)
            rows = [out.logits[-1].float()]
            for token in fed[:-1]:
                rows.append(backend.decode(torch.tensor([token], device="cuda"), state).logits[-1].float())
            runs[label] = kld(want, torch.stack(rows))
            if label == "fast":
                got = torch.stack(rows)
    fast, scale = runs["fast"], runs["reference"]
    print(
        f"\nmegakernel decode vs fp32 reference: after the fast prefill KLD mean {fast.mean():.2e} max "
        f"{fast.max():.2e}; after the bf16 reference prefill {scale.mean():.2e} max {scale.max():.2e}"
    )
    assert float(fast.mean()) <= max(KLD_BAR, 1.25 * float(scale.mean()))
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= TIE_MARGIN
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])

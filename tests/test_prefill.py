"""The fast prefill path (worker/prefill/) against the reference model, on the CPU in fp32.

The chunked delta rule is checked against the token-by-token recurrence; the whole path against the
reference model's own prefill: the states it leaves (KV caches, conv windows, recurrent states), the
logits of the decode that continues from them, piece boundaries, a session's second turn, the MTP head and
quantized weights.
"""

from __future__ import annotations

import pytest
import torch
from onestream.worker.backend import ReferenceBackend, create_backend
from onestream.worker.errors import BackendUnavailableError, InvalidRequestError
from onestream.worker.layers.deltanet import l2_normalize, recurrent_delta_step
from onestream.worker.model import Qwen35ForCausalLM
from onestream.worker.prefill import DeltaRuleKernel, FastPrefill, chunk_gated_delta_rule_torch
from onestream.worker.quant import (
    QuantizedLinear,
    QuantizedWeight,
    QuantShapeError,
    QuantType,
    dequantize,
    install_quantized_weights,
)
from onestream.worker.quant.scratch import DequantScratch
from onestream.worker.sequence import Sequence
from onestream.worker.state import SequenceState
from onestream.worker.testing import random_weights, tiny_config, write_tiny_checkpoint
from torch import nn

torch.set_num_threads(2)

KLD_BAR = 1e-3  # nats: the bar for decode after the fast prefill against the fp32 reference
TIE_MARGIN = 1e-4  # top-2 logit gap under which a greedy choice is a tie (either token is right)


def build_model(seed: int = 3, **overrides: object) -> Qwen35ForCausalLM:
    cfg = tiny_config(**overrides)
    weights = random_weights(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name in weights:
        if name.endswith("A_log"):  # slow decay: the state carries information across pieces
            weights[name] = torch.empty(weights[name].shape).uniform_(0.05, 1.0, generator=gen).log()
    model = Qwen35ForCausalLM(cfg)
    model.load_state_dict(weights)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> Qwen35ForCausalLM:
    return build_model()


def tokens(model: Qwen35ForCausalLM, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def assert_states_equal(a: SequenceState, b: SequenceState, atol: float = 2e-5) -> None:
    assert a.length == b.length and a.token_ids == b.token_ids
    for i in a.conv:
        assert a.conv[i].dtype == b.conv[i].dtype and a.conv[i].shape == b.conv[i].shape
        torch.testing.assert_close(a.conv[i], b.conv[i], atol=atol, rtol=0)
        assert b.recurrent[i].dtype == torch.float32
        torch.testing.assert_close(a.recurrent[i], b.recurrent[i], atol=atol, rtol=1e-4)
    for i in a.kv:
        n = a.length
        torch.testing.assert_close(a.kv[i].k[:, :n], b.kv[i].k[:, :n], atol=atol, rtol=1e-4)
        torch.testing.assert_close(a.kv[i].v[:, :n], b.kv[i].v[:, :n], atol=atol, rtol=1e-4)


def kld(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) per row, nats."""
    p = reference.float().log_softmax(-1)
    return (p.exp() * (p - other.float().log_softmax(-1))).sum(-1)


# ---- the delta rule -------------------------------------------------------------------------------------
def recurrence(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    outs = [
        recurrent_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state) for t in range(k.shape[1])
    ]
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("chunk", [1, 8, 16, 64])
@pytest.mark.parametrize("length", [1, 37, 130])
def test_chunked_delta_rule_equals_the_recurrence(chunk: int, length: int) -> None:
    gen = torch.Generator().manual_seed(chunk * 1000 + length)
    h, dk, dv = 3, 16, 24
    q = l2_normalize(torch.randn(h, length, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(h, length, dk, generator=gen))
    v = torch.randn(h, length, dv, generator=gen)
    g = -torch.rand(h, length, generator=gen) * 2.0  # strong and weak decay
    beta = torch.rand(h, length, generator=gen)
    state = torch.randn(h, dk, dv, generator=gen)
    want_out, want_state = recurrence(q, k, v, g, beta, state.clone())
    out, final = chunk_gated_delta_rule_torch(q, k, v, g, beta, state.clone(), chunk)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state, atol=2e-5, rtol=1e-5)


def test_chunked_delta_rule_survives_total_decay() -> None:
    # g of -200 per token underflows e^c to zero inside a chunk: the state must be forgotten, not NaN.
    gen = torch.Generator().manual_seed(5)
    h, t, d = 2, 50, 8
    q, k = (l2_normalize(torch.randn(h, t, d, generator=gen)) for _ in range(2))
    v = torch.randn(h, t, d, generator=gen)
    g = torch.full((h, t), -200.0)
    beta = torch.rand(h, t, generator=gen)
    state = torch.randn(h, d, d, generator=gen)
    out, final = chunk_gated_delta_rule_torch(q, k, v, g, beta, state.clone(), 16)
    want_out, want_state = recurrence(q, k, v, g, beta, state.clone())
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-5)


def test_delta_rule_kernel_choice_on_the_cpu() -> None:
    assert DeltaRuleKernel(torch.device("cpu")).name == "torch"
    with pytest.raises(InvalidRequestError, match="fla"):
        DeltaRuleKernel(torch.device("cpu"), "fla")
    with pytest.raises(InvalidRequestError, match="one of"):
        DeltaRuleKernel(torch.device("cpu"), "cuda-graph")
    with pytest.raises(InvalidRequestError, match="chunk"):
        chunk_gated_delta_rule_torch(
            *(torch.zeros(1, 2, 4) for _ in range(3)),
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.zeros(1, 4, 4),
            chunk=0,
        )


# ---- the whole path against the reference ------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [16, 64])
def test_fast_prefill_leaves_the_reference_state(model: Qwen35ForCausalLM, chunk: int) -> None:
    ids = tokens(model, 150, seed=1)
    ref_state, fast_state = model.new_state(400), model.new_state(400)
    with torch.inference_mode():
        want = model.forward_step(ids, ref_state, logits="last")
        got = FastPrefill(model, chunk=chunk)(ids, fast_state)
    assert got.logits.shape == (1, model.config.vocab_size) and got.hidden.shape == want.hidden.shape
    torch.testing.assert_close(got.hidden, want.hidden, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert fast_state.history is None and fast_state.mtp_length == 0
    assert_states_equal(ref_state, fast_state)


def test_pieces_across_chunk_boundaries_equal_one_shot(model: Qwen35ForCausalLM) -> None:
    ids = tokens(model, 203, seed=2)
    fast = FastPrefill(model, chunk=16)
    one, pieces = model.new_state(400), model.new_state(400)
    with torch.inference_mode():
        whole = fast(ids, one)
        for a, b in [(0, 5), (5, 70), (70, 71), (71, 203)]:  # 1- and 5-token pieces, none on a chunk edge
            last = fast(ids[a:b], pieces)
    torch.testing.assert_close(last.logits, whole.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last.hidden[-1], whole.hidden[-1], atol=5e-5, rtol=1e-4)
    assert_states_equal(one, pieces)


def greedy_decode(
    model: Qwen35ForCausalLM, state: SequenceState, first: torch.Tensor, n: int
) -> torch.Tensor:
    """Logits of n greedy reference decode steps from `first` (the prefill's last logits)."""
    rows, logits = [], first
    with torch.inference_mode():
        for _ in range(n):
            rows.append(logits[-1])
            token = logits[-1].argmax().reshape(1)
            logits = model.forward_step(token, state).logits
    return torch.stack(rows)


def test_decode_after_fast_prefill_matches_the_reference(model: Qwen35ForCausalLM) -> None:
    ids = tokens(model, 180, seed=3)
    ref_state, fast_state = model.new_state(400), model.new_state(400)
    with torch.inference_mode():
        want_first = model.forward_step(ids, ref_state, logits="last").logits
        got_first = FastPrefill(model, chunk=32)(ids, fast_state).logits
    want = greedy_decode(model, ref_state, want_first, 16)
    got = greedy_decode(model, fast_state, got_first, 16)
    top2 = want.topk(2, dim=-1).values
    ties = (top2[:, 0] - top2[:, 1]) < TIE_MARGIN
    # the continuations agree up to the first tie (after one, each may rightly take another path)
    stop = int(ties.nonzero()[0, 0]) if ties.any() else len(want)
    assert stop > 0
    assert torch.equal(want[:stop].argmax(-1), got[:stop].argmax(-1))
    assert float(kld(want[:stop], got[:stop]).max()) <= KLD_BAR


def test_second_turn_continues_the_session(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = build_model(seed=7)
    ref = ReferenceBackend(model)
    fast = ReferenceBackend(model, prefill="fast")
    assert fast.fast_prefill is not None and fast.prefill_tokens > ref.prefill_tokens
    fast.prefill_tokens = 40  # several pieces per turn, each past the first continuing from the cache
    turns = [tokens(model, 130, seed=11).tolist(), tokens(model, 57, seed=12).tolist()]
    outs = []
    for backend in (ref, fast):
        seq = Sequence(backend, 400, track_mtp=True)
        out = seq.feed(turns[0])
        reply = [int(out.logits[-1].argmax())]
        for _ in range(3):  # a few decoded tokens between the turns, as a session has
            reply.append(int(seq.feed(reply[-1:]).logits[-1].argmax()))
        seq.feed(reply[:-1])
        out = seq.feed(turns[1])
        seq.flush_mtp()
        outs.append((out, seq))
    (want, ref_seq), (got, fast_seq) = outs
    torch.testing.assert_close(got.logits, want.logits, atol=2e-4, rtol=1e-4)
    assert_states_equal(ref_seq.state, fast_seq.state)
    # the MTP head's cache was filled by the fast path in pieces too
    assert fast_seq.state.mtp_length == ref_seq.state.mtp_length == len(fast_seq) - 1
    n = ref_seq.state.mtp_length
    assert ref_seq.state.mtp_kv is not None and fast_seq.state.mtp_kv is not None
    torch.testing.assert_close(
        fast_seq.state.mtp_kv.k[:, :n], ref_seq.state.mtp_kv.k[:, :n], atol=5e-5, rtol=1e-4
    )


def test_fast_mtp_equals_the_reference_mtp_step(model: Qwen35ForCausalLM) -> None:
    ids = tokens(model, 90, seed=4)
    fast = FastPrefill(model)
    ref_state, fast_state = model.new_state(200), model.new_state(200)
    with torch.inference_mode():
        hidden = model.forward_step(ids, ref_state).hidden
        fast(ids, fast_state)
        for a, b in [(0, 50), (50, 89)]:
            want = model.mtp_step(ids[a + 1 : b + 1], hidden[a:b], ref_state, logits="last")
            got = fast.mtp(ids[a + 1 : b + 1], hidden[a:b], fast_state)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.hidden, want.hidden, atol=5e-5, rtol=1e-4)
    assert fast_state.mtp_length == ref_state.mtp_length == 89
    with pytest.raises(InvalidRequestError, match="hidden must have shape"):
        fast.mtp(ids[:3], hidden[:2], fast_state)


def test_quantized_weights_prefill_one_matrix_at_a_time() -> None:
    model = build_model(seed=9)
    weights = {
        f"{name}.weight": QuantizedWeight.from_float(QuantType.Q8_0, module.weight.detach())
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    }
    install_quantized_weights(model, weights, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == len(weights)
    ids = tokens(model, 120, seed=5)
    ref_state, fast_state = model.new_state(200), model.new_state(200)
    with torch.inference_mode():
        want = model.forward_step(ids, ref_state, logits="last")
        got = FastPrefill(model, chunk=32)(ids, fast_state)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert_states_equal(ref_state, fast_state)
    # each matrix was dequantized for its own GEMM and dropped: no dequantized copy stays behind
    assert all(m.dequantized is None for m in linears)


def mixed_quantized_model() -> Qwen35ForCausalLM:
    """Rows of 256 where the K-quants fit: Q4_K projections, Q6_K down projections and head, Q8_0 elsewhere
    (q4_k_m's types), every linear layer and the output head quantized."""
    model = build_model(seed=12, hidden_size=256, intermediate_size=512)
    weights = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        cols = module.weight.shape[1]
        qtype = QuantType.Q8_0 if cols % 256 else QuantType.Q4_K
        if name.endswith(("down_proj", "lm_head")) and cols % 256 == 0:
            qtype = QuantType.Q6_K
        weights[f"{name}.weight"] = QuantizedWeight.from_float(qtype, module.weight.detach())
    install_quantized_weights(model, weights, dtype=torch.float32)
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.qtype == QuantType.Q6_K
    return model


@pytest.mark.parametrize("scratch_elements", [None, 5000])
def test_quantized_prefill_dequantizes_into_one_scratch(monkeypatch, scratch_elements: int | None) -> None:
    """The fast path over quantized weights (through its reused scratch, in row slices when the scratch is
    smaller than a matrix) leaves the reference's state and logits, and never dequantizes a whole weight."""
    model = mixed_quantized_model()
    ids = tokens(model, 150, seed=6)
    ref_state, fast_state = model.new_state(200), model.new_state(200)
    with torch.inference_mode():
        want = model.forward_step(ids, ref_state, logits="last")
    fast = FastPrefill(model, chunk=32)
    assert fast.scratch is not None
    # the largest layer matrix: a head larger than that (a real vocabulary) goes through it in slices
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m is not model.lm_head]
    assert fast.scratch.buffer.numel() == max(m.shape[0] * m.shape[1] for m in layers)
    if scratch_elements is not None:
        fast.scratch = DequantScratch(scratch_elements, torch.float32, torch.device("cpu"))
    fills: list[int] = []
    fill = DequantScratch.fill

    def counting_fill(self, weight, start, stop):  # type: ignore[no-untyped-def]
        fills.append((stop - start) * weight.shape[1])
        return fill(self, weight, start, stop)

    def whole(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the fast prefill dequantized a whole weight outside its scratch")

    monkeypatch.setattr(DequantScratch, "fill", counting_fill)
    monkeypatch.setattr(QuantizedWeight, "dequantize", whole)
    got = fast(ids, fast_state)
    monkeypatch.undo()
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.hidden, want.hidden, atol=5e-5, rtol=1e-4)
    assert_states_equal(ref_state, fast_state)
    assert fills and max(fills) <= fast.scratch.buffer.numel()
    if scratch_elements is not None:  # every matrix went through in slices
        assert len(fills) > len([m for m in model.modules() if isinstance(m, QuantizedLinear)])
    assert "scratch (torch codec)" in fast.description


def test_quantized_prefill_after_the_megakernel_took_the_weights(monkeypatch) -> None:
    """Once the megakernel's runner has repacked the weights (the modules hand their GGUF bytes over,
    kernels/quant_weights.py), the fast path reads the repacked copy a slab at a time: the same logits and state."""
    from onestream.kernels.quant_weights import DeviceWeights
    from onestream.worker.quant import weight as weight_module

    model = mixed_quantized_model()
    ids = tokens(model, 150, seed=6)
    ref_state, fast_state = model.new_state(200), model.new_state(200)
    with torch.inference_mode():
        want = model.forward_step(ids, ref_state, logits="last")
    fast = FastPrefill(model, chunk=32)
    DeviceWeights(model, [*model.model.layers, *model.mtp.layers], has_mtp=True)
    assert all(m.source is not None for m in model.modules() if isinstance(m, QuantizedLinear))
    fast.weights_moved()
    assert fast.scratch is None  # nothing decodes GGUF bytes any more: no scratch held for it
    monkeypatch.setattr(weight_module, "SLAB_ELEMENTS", 5000)  # every matrix in slabs
    got = fast(ids, fast_state)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert_states_equal(ref_state, fast_state)


def test_dequantize_into_a_buffer_equals_the_codec() -> None:
    gen = torch.Generator().manual_seed(8)
    weights = torch.randn(6, 512, generator=gen) * 0.05
    for qtype in (QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0, QuantType.F16):
        quantized = QuantizedWeight.from_float(qtype, weights)
        want = quantized.dequantize(torch.float32)
        scratch = DequantScratch(512 * 4, torch.float32, torch.device("cpu"))
        torch.testing.assert_close(scratch.fill(quantized, 2, 6), want[2:6], atol=0, rtol=0)
        x = torch.randn(3, 512, generator=gen)
        torch.testing.assert_close(scratch.linear(quantized, x), x @ want.T, atol=1e-5, rtol=1e-5)
        out = torch.empty(6 * 512, dtype=torch.bfloat16)
        assert dequantize(qtype, quantized.raw, (6, 512), out=out).data_ptr() == out.data_ptr()
        torch.testing.assert_close(out.view(6, 512), want.bfloat16(), atol=0, rtol=0)
    with pytest.raises(QuantShapeError, match="out must be a contiguous tensor of 3072"):
        dequantize(quantized.qtype, quantized.raw, (6, 512), out=torch.empty(10))
    with pytest.raises(InvalidRequestError, match="rows 0:6 of a"):
        DequantScratch(100, torch.float32, torch.device("cpu")).fill(quantized, 0, 6)
    with pytest.raises(InvalidRequestError, match="dequantizer must be one of"):
        DequantScratch(100, torch.float32, torch.device("cpu"), "fast")
    with pytest.raises(InvalidRequestError, match="needs triton and a CUDA device"):
        DequantScratch(100, torch.float32, torch.device("cpu"), "triton")


def test_backend_prefill_choice(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model_dir = write_tiny_checkpoint(tmp_path / "m", seed=1)
    assert create_backend(model_dir, kind="auto").fast_prefill is None  # the CPU: the reference path
    assert create_backend(model_dir, kind="reference", prefill="fast").fast_prefill is not None
    monkeypatch.setenv("ONESTREAM_PREFILL", "fast")
    monkeypatch.setenv("ONESTREAM_PREFILL_TOKENS", "1024")
    backend = create_backend(model_dir, kind="auto")
    assert backend.fast_prefill is not None and backend.prefill_tokens == 1024
    monkeypatch.setenv("ONESTREAM_PREFILL", "quick")
    with pytest.raises(BackendUnavailableError, match="prefill must be one of"):
        create_backend(model_dir)
    monkeypatch.setenv("ONESTREAM_PREFILL", "fast")
    monkeypatch.setenv("ONESTREAM_PREFILL_TOKENS", "many")
    with pytest.raises(InvalidRequestError, match="ONESTREAM_PREFILL_TOKENS"):
        create_backend(model_dir)


def test_row_blocks_and_in_place_swiglu_give_the_same_bits(model: Qwen35ForCausalLM, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The prefill's fp32 elementwise work in blocks of rows (conv, gated norm) and the SwiGLU's in-place inference
    path change what a piece holds, not a bit of its output: a block of 7 rows against one block for the whole
    piece, and the SwiGLU without autograd against the same SwiGLU with it."""
    from onestream.worker.prefill import elementwise

    ids = tokens(model, 150, seed=3)
    outputs = []
    for block in (7, 1 << 20):
        monkeypatch.setattr(elementwise, "ROW_BLOCK_TOKENS", block)
        state = model.new_state(400)
        with torch.inference_mode():
            outputs.append(FastPrefill(model)(ids, state))
    assert torch.equal(outputs[0].hidden, outputs[1].hidden)
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    layer = model.model.layers[0]
    h = torch.randn(33, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        in_place = layer._mlp_residual(h)
        prefill_form = FastPrefill(model, elementwise="torch")._mlp_residual(layer, h)
    assert torch.equal(in_place, layer._mlp_residual(h).detach())
    assert torch.equal(prefill_form, in_place)

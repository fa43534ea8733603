"""MTP speculative decoding: exact greedy equivalence, distribution-preserving rejection sampling, and the
state (main model and MTP cache) after accepting and rolling back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from onestream.worker.api import SamplingParams
from onestream.worker.backend import ReferenceBackend, accept_greedy
from onestream.worker.engine import Engine, GenerateRequest
from onestream.worker.loading import load_model
from onestream.worker.sampling import RequestSampler
from onestream.worker.sequence import Sequence, join_rows
from onestream.worker.speculative import (
    SpecStats,
    SpeculativeDecoder,
    accept_sampled,
    resolve_sampled,
    settle,
)
from onestream.worker.testing import write_tiny_checkpoint
from onestream.worker.testing_spec import generate_ids, write_draftable_checkpoint

torch.set_num_threads(1)
CHI2_999 = {4: 18.47, 5: 20.52, 7: 24.32}  # 0.999 quantiles of chi-square by degrees of freedom


@pytest.fixture(scope="module")
def draftable_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_draftable_checkpoint(tmp_path_factory.mktemp("draftable"), seed=5)


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("random"), seed=11)


@pytest.fixture(scope="module")
def engine(draftable_dir: Path) -> Engine:
    # The MTP head's own cycles (copies from the context and the combination: tests/test_drafting.py).
    return Engine(draftable_dir, backend="reference", device="cpu", dtype="fp32", drafting="mtp")


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            0, vocab, (int(torch.randint(1, 40, (1,), generator=generator)),), generator=generator
        ).tolist()
        for _ in range(n)
    ]


# ---- acceptance rules, driven directly ------------------------------------------------------------


def test_accept_greedy_takes_the_matching_prefix() -> None:
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == (3, 7)
    assert accept_greedy([4, 5, 6, 7], [4, 9, 6]) == (1, 5)
    assert accept_greedy([4, 5], [8]) == (0, 4)
    assert accept_greedy([3], []) == (0, 3)


def fixed_distributions(k: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=generator) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=generator) * 1.5, dim=-1)
    return p, q


def chi_square(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


def speculative_outputs(p: torch.Tensor, q: torch.Tensor, trials: int, seed: int) -> list[list[int]]:
    """The token sequences speculative sampling emits for `trials` independent cycles."""
    k = q.shape[0]
    draft_generator = torch.Generator().manual_seed(seed)
    accept_generator = torch.Generator().manual_seed(seed + 1)
    drafts_all = torch.stack(
        [torch.multinomial(q[j], trials, replacement=True, generator=draft_generator) for j in range(k)], 1
    )
    outputs = []
    for drafts in drafts_all.tolist():
        accepted, token = accept_sampled(p, q, drafts, accept_generator)
        outputs.append([*drafts[:accepted], token])
    return outputs


def test_settling_on_the_device_agrees_with_the_host_rules() -> None:
    generator = torch.Generator().manual_seed(8)
    for _ in range(200):
        k = int(torch.randint(1, 6, (1,), generator=generator))
        targets = torch.randint(0, 4, (k + 1,), generator=generator)
        drafts = torch.randint(0, 4, (k,), generator=generator)
        settled = settle(drafts != targets[:k], targets[:k], targets[k]).tolist()
        assert tuple(settled) == accept_greedy(targets.tolist(), drafts.tolist())
        decisions = torch.cat(
            [
                torch.randint(0, 2, (k,), generator=generator),
                torch.randint(0, 9, (k + 1,), generator=generator),
            ]
        )
        settled = settle(decisions[:k].bool(), decisions[k : 2 * k], decisions[2 * k]).tolist()
        assert tuple(settled) == resolve_sampled(decisions.tolist(), k)


def test_backend_greedy_verification_accepts_the_matching_prefix(random_dir: Path) -> None:
    backend = ReferenceBackend(load_model(random_dir, dtype=torch.float32))
    state = backend.new_state(64)
    backend.prefill(torch.tensor([3, 1, 4, 1, 5]), state)
    # The greedy chain after token 9: drafts equal to it are accepted until the first one that is not.
    chain, probe = [9], state.clone()
    for _ in range(4):
        chain.append(int(backend.decode(torch.tensor(chain[-1:]), probe).logits[-1].argmax()))
    for wrong_at in range(1, 6):
        inputs = list(chain)
        if wrong_at < 5:
            inputs[wrong_at] = (inputs[wrong_at] + 1) % backend.config.vocab_size
        trial = state.clone()
        out, accepted, targets, echoed = backend.verify_greedy(torch.tensor(inputs), trial)
        assert accepted == wrong_at - 1 and echoed == inputs
        assert targets == out.logits.argmax(dim=-1).tolist() and targets[: wrong_at - 1] == chain[1:wrong_at]
        trial.rollback(len(inputs) - accepted - 1)  # the verify kept every position reachable
        assert trial.length == state.length + accepted + 1


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rejection_sampling_reproduces_the_target_distribution(k: int) -> None:
    vocab, trials = 6, 20_000
    p, q = fixed_distributions(k, vocab, seed=k)
    outputs = speculative_outputs(p, q, trials, seed=100 + k)
    # The first emitted token is distributed as p_0.
    first = [o[0] for o in outputs]
    assert chi_square(first, p[0]) < CHI2_999[vocab - 1]
    if k >= 2:
        # Given the first draft was accepted, the next token is distributed as p_1.
        second = [o[1] for o in outputs if len(o) >= 2]
        assert len(second) > 2000
        assert chi_square(second, p[1]) < CHI2_999[vocab - 1]
    # Acceptance rate of draft 1 is sum(min(p, q)) (Leviathan et al., theorem 3.5).
    accepted_first = sum(len(o) > 1 or (k == 0) for o in outputs) / trials
    expected = float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted_first - expected) < 0.02


def test_the_statistical_test_detects_a_wrong_sampler() -> None:
    """Negative control: accepting every draft yields q, which the same test must reject."""
    p, q = fixed_distributions(1, 6, seed=1)
    generator = torch.Generator().manual_seed(7)
    drafts = torch.multinomial(q[0], 20_000, replacement=True, generator=generator).tolist()
    assert chi_square(drafts, p[0]) > CHI2_999[5]


def test_identical_distributions_accept_everything() -> None:
    p, _ = fixed_distributions(2, 8, seed=3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        drafts = [int(torch.multinomial(p[j], 1, generator=generator)) for j in range(2)]
        accepted, _ = accept_sampled(p, p[:2].clone(), drafts, generator)
        assert accepted == 2


# ---- greedy: identical to plain decoding ----------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculative_greedy_equals_plain_greedy(engine: Engine, k: int) -> None:
    prompts = random_prompts(12, engine.config.vocab_size, seed=k)
    accepted = drafted = 0
    for prompt in prompts:
        request = GenerateRequest(prompt, SamplingParams(temperature=0.0), max_tokens=40, ignore_eos=True)
        engine.spec_k = 0
        plain, _ = generate_ids(engine, request)
        engine.spec_k = k
        spec, finished = generate_ids(engine, request)
        assert spec == plain, f"k={k}, prompt {prompt}"
        usage = finished.usage
        assert usage.generated_tokens == len(spec) == 40
        assert usage.draft_tokens <= k * usage.drafts
        assert sum(usage.accepted_per_position) == usage.accepted_draft_tokens
        assert all(
            a >= b for a, b in zip(usage.accepted_per_position, usage.accepted_per_position[1:], strict=False)
        )
        accepted += usage.accepted_draft_tokens
        drafted += usage.draft_tokens
    # The draftable model accepts some drafts and rejects others: both rollback paths ran.
    assert 0.2 < accepted / drafted < 0.95


def test_speculative_greedy_with_penalties_equals_plain(engine: Engine) -> None:
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2
    )
    for prompt in random_prompts(6, engine.config.vocab_size, seed=99):
        request = GenerateRequest(prompt, params, max_tokens=30, ignore_eos=True)
        engine.spec_k = 0
        plain, _ = generate_ids(engine, request)
        engine.spec_k = 3
        spec, _ = generate_ids(engine, request)
        assert spec == plain


def test_untrained_mtp_head_still_gives_plain_greedy(random_dir: Path) -> None:
    engine = Engine(random_dir, backend="reference", device="cpu", dtype="fp32", drafting="mtp")
    for prompt in random_prompts(6, engine.config.vocab_size, seed=5):
        request = GenerateRequest(prompt, SamplingParams(temperature=0.0), max_tokens=24, ignore_eos=True)
        engine.spec_k = 0
        plain, _ = generate_ids(engine, request)
        engine.spec_k = 2
        spec, _ = generate_ids(engine, request)
        assert spec == plain


# ---- the state after cycles --------------------------------------------------------------------------


@pytest.mark.parametrize("piece", [512, 4])
@pytest.mark.parametrize("prefix", [False, True], ids=["whole-vocab", "draft-vocab"])
def test_greedy_drafts_as_one_chain_equal_the_stepwise_drafts(
    draftable_dir: Path, piece: int, prefix: bool
) -> None:
    """`Sequence.draft_greedy` (the back end's chain of draft steps: the megakernel feeds each draft and hidden
    on the device) drafts what the step-by-step path drafts from the host's argmax and leaves the same MTP
    cache; a `piece` shorter than the owed pairs cuts them into several calls first. With a draft vocabulary
    each draft is the argmax among its first ids (worker/draft_vocab.py)."""
    model = load_model(draftable_dir, dtype=torch.float32)
    backend = ReferenceBackend(model)
    backend.prefill_tokens = piece
    backend.draft_vocab = model.config.vocab_size // 4 // 8 * 8 if prefix else None
    vocab = backend.draft_vocab or model.config.vocab_size
    prompt = [(17 * i + 3) % model.config.vocab_size for i in range(13)]
    chained, stepped = (Sequence(backend, 128, track_mtp=True) for _ in range(2))
    for seq in (chained, stepped):
        seq.feed(prompt)
    k, pending = 4, 7
    drafts = chained.draft_greedy(pending, k)
    out = stepped.draft_first(pending)
    expected = [out.logits[-1:, :vocab].argmax(dim=-1)]
    for _ in range(k - 1):
        out = stepped.draft_next(expected[-1], out.hidden[-1:])
        expected.append(out.logits[-1:, :vocab].argmax(dim=-1))
    assert torch.equal(drafts, torch.cat(expected))
    assert int(drafts.max()) < vocab
    m = stepped.state.mtp_length
    assert chained.state.mtp_length == m == len(prompt) + k - 1
    assert torch.equal(chained.state.mtp_kv.k[:, :m], stepped.state.mtp_kv.k[:, :m])
    assert torch.equal(chained.state.mtp_kv.v[:, :m], stepped.state.mtp_kv.v[:, :m])


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_cycles_keep_main_state_and_mtp_cache_complete(draftable_dir: Path, temperature: float) -> None:
    """Sampled cycles draft step by step; greedy ones as one chain of draft steps (`Sequence.draft_greedy`)."""
    model = load_model(draftable_dir, dtype=torch.float32)
    backend = ReferenceBackend(model)
    seq = Sequence(backend, 512, track_mtp=True)
    prompt = random_prompts(1, model.config.vocab_size, seed=21)[0]
    params = SamplingParams(temperature=temperature, seed=3)
    sampler = RequestSampler(params, prompt, model.config.vocab_size, "cpu")
    stats = SpecStats()
    decoder = SpeculativeDecoder(3, stats)
    out = seq.feed(prompt)
    pending = int(sampler.next_tokens(out.logits[-1:])[0])
    emitted = [pending]
    for cycle_index in range(15):
        cycle = decoder.propose(seq, pending, sampler, 3)
        kept = len(cycle.tokens) if cycle_index % 4 else 1  # sometimes keep fewer, as a stop would
        decoder.commit(seq, cycle, kept)
        sampler.commit(cycle.tokens[:kept])
        emitted.extend(cycle.tokens[:kept])
        pending = emitted[-1]
    assert 0 < stats.accepted_tokens <= stats.draft_tokens
    assert stats.accepted_tokens < stats.draft_tokens or temperature == 0.0

    consumed = prompt + emitted[:-1]
    assert seq.tokens == consumed and seq.state.length == len(consumed)
    seq.flush_mtp()
    assert seq.state.mtp_length == len(consumed) - 1

    # A fresh state fed the same tokens in one pass must hold the same caches.
    fresh = model.new_state(512)
    ref = model.forward_step(torch.tensor(consumed), fresh)
    model.mtp_step(torch.tensor(consumed[1:]), ref.hidden[:-1], fresh)
    n, m = len(consumed), len(consumed) - 1
    for layer, cache in seq.state.kv.items():
        torch.testing.assert_close(cache.k[:, :n], fresh.kv[layer].k[:, :n], rtol=1e-4, atol=1e-4)
    for layer in seq.state.recurrent:
        torch.testing.assert_close(seq.state.recurrent[layer], fresh.recurrent[layer], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(seq.state.mtp_kv.k[:, :m], fresh.mtp_kv.k[:, :m], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(seq.state.mtp_kv.v[:, :m], fresh.mtp_kv.v[:, :m], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(seq.last_hidden, ref.hidden[-1], rtol=1e-4, atol=1e-4)


# ---- sampling through the engine ---------------------------------------------------------------------


def test_seeded_speculative_sampling_is_reproducible(engine: Engine) -> None:
    engine.spec_k = 3
    request = GenerateRequest(
        [5, 6, 7], SamplingParams(temperature=1.0, top_p=0.9, seed=42), max_tokens=30, ignore_eos=True
    )
    first, finished = generate_ids(engine, request)
    second, _ = generate_ids(engine, request)
    assert first == second
    assert finished.usage.drafts > 0
    other, _ = generate_ids(
        engine,
        GenerateRequest(
            [5, 6, 7], SamplingParams(temperature=1.0, top_p=0.9, seed=43), max_tokens=30, ignore_eos=True
        ),
    )
    assert other != first


def test_speculative_sampling_matches_plain_sampling_in_distribution(engine: Engine) -> None:
    """End to end: the first two generated tokens (the second one decided by a verify pass, from an accepted
    draft or the residual distribution) are distributed alike with and without drafts: a two-sample
    chi-square over the pairs seen often enough."""
    prompt = [40, 41, 42]
    runs = 300
    counts: dict[int, dict[tuple[int, ...], int]] = {0: {}, 2: {}}
    for k, seen in counts.items():
        engine.spec_k = k
        drafts = 0
        for seed in range(runs):
            params = SamplingParams(temperature=1.0, seed=seed)
            ids, finished = generate_ids(
                engine, GenerateRequest(prompt, params, max_tokens=3, ignore_eos=True)
            )
            seen[tuple(ids[:2])] = seen.get(tuple(ids[:2]), 0) + 1
            drafts += finished.usage.draft_tokens
        assert (drafts > 0) == (k > 0)
    keys = [
        key for key in set(counts[0]) | set(counts[2]) if counts[0].get(key, 0) + counts[2].get(key, 0) >= 20
    ]
    a = torch.tensor([counts[0].get(key, 0) for key in keys], dtype=torch.float64)
    b = torch.tensor([counts[2].get(key, 0) for key in keys], dtype=torch.float64)
    chi2 = float(((a - b) ** 2 / (a + b)).sum())
    dof = len(keys) - 1
    assert dof >= 3
    # 0.999 quantile of chi-square (Wilson-Hilferty approximation).
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < bound
    assert (
        counts[0] != counts[2]
    )  # the runs really differ (different random streams), only in distribution alike


@pytest.mark.parametrize("inference", [False, True])
def test_join_rows_is_a_view_of_consecutive_rows_and_a_copy_otherwise(inference: bool) -> None:
    """The MTP pairs after a verify are its output's first rows: joined without a copy, equal to `torch.cat`;
    also for the inference tensors the megakernel back end returns (their views record no base)."""
    if inference:
        with torch.inference_mode():
            out = torch.randn(6, 5)
    else:
        out = torch.randn(6, 5)
    kept = join_rows([out[:2], out[2].unsqueeze(0)])
    assert torch.equal(kept, out[:3])
    assert kept.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert join_rows([out[1:2]]).untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert torch.equal(join_rows([out[:2, :4], out[2:3, :4]]), out[:3, :4])  # strided rows join too
    for pieces in (
        [out[:2], out[3:4]],
        [out[2:3], out[:2]],
        [out[:2], torch.randn(1, 5)],
        [out[:2, :4], out[2:3, 1:]],
    ):
        joined = join_rows(pieces)
        assert torch.equal(joined, torch.cat(pieces))
        assert joined.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()


def test_reference_draft_chain_takes_host_ids(draftable_dir: Path) -> None:
    """`draft_greedy` takes the pairs' ids from the host as well as on the device, with the same drafts."""
    model = load_model(draftable_dir, dtype=torch.float32)
    backend = ReferenceBackend(model)
    prompt = [(5 * i + 1) % model.config.vocab_size for i in range(9)]
    results = []
    for host in (True, False):
        seq = Sequence(backend, 64, track_mtp=True)
        seq.feed(prompt)
        tokens, hidden = seq._first_pairs(11)
        ids = tokens if host else seq.ids(tokens)
        results.append(backend.draft_greedy(ids, hidden, seq.state, 3))
    assert torch.equal(results[0], results[1])

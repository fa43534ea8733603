"""Drafts for speculative decoding (worker/drafting/): the n-gram index against a brute-force scan, adaptive
lengths, greedy output identical to plain greedy with copied and combined drafts, and rejection sampling
that treats a copied draft as deterministic (q one-hot) preserving the target distribution."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from onestream.worker.api import SamplingParams
from onestream.worker.drafting import LOOKUP, MTP, AdaptiveLength, Draft, NGramIndex, draft_distributions
from onestream.worker.drafting.policy import DraftPolicy, DraftSettings, LookupDrafter
from onestream.worker.engine import Engine, GenerateRequest
from onestream.worker.speculative import accept_sampled
from onestream.worker.testing_spec import generate_ids, write_draftable_checkpoint

torch.set_num_threads(1)
CHI2_999_DOF5 = 20.52  # 0.999 quantile of chi-square with 5 degrees of freedom


def brute_continuation(tokens: list[int], n_min: int, n_max: int, limit: int) -> tuple[list[int], int]:
    """The longest suffix (n_min..n_max tokens) that occurred earlier, what followed its latest earlier
    occurrence: by scanning."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):  # an occurrence ending before the last token
            if tokens[end - n : end] == suffix:
                return tokens[end : end + limit], n
    return [], 0


def brute_continuation_after(
    tokens: list[int], after: list[int], n_min: int, n_max: int, limit: int
) -> tuple[list[int], int]:
    """`brute_continuation` of tokens + after, counting only occurrences that lie within `tokens` (what the
    index holds), the continuation read on into `after`."""
    joined = tokens + after
    for n in range(min(n_max, len(joined) - 1), n_min - 1, -1):
        suffix = joined[len(joined) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return joined[end : end + limit], n
    return [], 0


# ---- the n-gram index ----------------------------------------------------------------------------------


def test_index_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    index = NGramIndex(1, 3)
    index.extend([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6])
    # [5, 6] occurred twice before the end; the latest continued with 7, 9, 2.
    assert index.continuation(3) == ([7, 9, 2], 2)
    index.extend([7])  # suffix [5, 6, 7]: latest earlier occurrence continued with 9
    assert index.continuation(4) == ([9, 2, 5, 6], 3)
    assert NGramIndex(2, 2).continuation(4) == ([], 0)
    fresh = NGramIndex(2, 3)
    fresh.extend([1, 2, 3])
    assert fresh.continuation(4) == ([], 0)  # the suffix itself is not an earlier occurrence


@pytest.mark.parametrize("seed", range(6))
def test_index_agrees_with_a_scan_on_random_token_streams(seed: int) -> None:
    rng = random.Random(seed)
    n_min, n_max = rng.choice([(1, 1), (1, 3), (2, 4), (3, 5)])
    index = NGramIndex(n_min, n_max)
    tokens: list[int] = []
    for _ in range(300):
        # Small vocabularies and copied runs make matches of every length common.
        if tokens and rng.random() < 0.3:
            start = rng.randrange(len(tokens))
            chunk = tokens[start : start + rng.randint(1, 6)]
        else:
            chunk = [rng.randrange(rng.choice([3, 8, 50])) for _ in range(rng.randint(1, 4))]
        index.extend(chunk)
        tokens.extend(chunk)
        limit = rng.randint(1, 8)
        assert index.continuation(limit) == brute_continuation(tokens, n_min, n_max, limit)
        after = [rng.randrange(8) for _ in range(rng.randint(1, 3))]  # an MTP draft to continue
        assert index.continuation(limit, after=after) == brute_continuation_after(
            tokens, after, n_min, n_max, limit
        )


def test_sync_extends_a_continued_session_and_rebuilds_a_changed_one() -> None:
    index = NGramIndex(1, 2)
    index.sync([1, 2, 3, 4])
    index.extend([1, 2])
    index.sync([1, 2, 3, 4, 1, 2, 9, 1])  # the next turn: the same tokens and more
    assert index.tokens == [1, 2, 3, 4, 1, 2, 9, 1] and index.continuation(2) == ([2, 9], 1)
    index.sync([7, 1, 5])  # an edited conversation: nothing of the old one may be proposed
    assert index.tokens == [7, 1, 5] and index.continuation(2) == ([], 0)
    index.extend([7])
    assert index.continuation(3) == ([1, 5, 7], 1)


def test_an_mtp_draft_is_continued_by_what_followed_its_ngram() -> None:
    index = NGramIndex(2, 3)
    index.extend([4, 5, 6, 7, 8, 1, 2, 3])
    # Context ... 2, 3 then the drafts 4, 5: [3, 4, 5] never occurred, [4, 5] did, followed by 6, 7, 8.
    assert index.continuation(3, after=[4, 5]) == ([6, 7, 8], 2)
    # The copy runs from the context on into the drafts themselves.
    looping = NGramIndex(2, 3)
    looping.extend([4, 5, 6, 1, 2, 3, 4])
    assert looping.continuation(7, after=[5]) == ([6, 1, 2, 3, 4, 5], 2)
    assert index.continuation(3, after=[9, 9]) == ([], 0)


def test_index_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match="n_min"):
        NGramIndex(0, 2)
    with pytest.raises(ValueError, match="n_min"):
        NGramIndex(3, 2)


def test_adaptive_length_shrinks_while_drafts_fail_and_grows_when_they_pass() -> None:
    length = AdaptiveLength(7)
    assert length.k == 7
    for expected in (6, 5, 4, 3, 2, 1, 1):
        length.update(length.k, 0)
        assert length.k == expected
    length.update(1, 1)
    assert length.k == 3
    for _ in range(5):
        length.update(length.k, length.k)
    assert length.k == 7


def test_only_lookup_lengths_adapt_mtp_drafts_keep_their_k() -> None:
    policy = DraftPolicy(DraftSettings(mode="combined", mtp_k=3, lookup_k=6), NGramIndex(2, 4))
    for _ in range(4):  # four failed cycles from each source
        policy.record(Draft(torch.zeros(3, dtype=torch.long), MTP), 0)
        policy.record(Draft(torch.zeros(6, dtype=torch.long), LOOKUP, host_tokens=[0] * 6), 0)
    assert policy.length(MTP, limit=7) == 3
    assert policy.length(LOOKUP, limit=7) == 2
    assert policy.length(MTP, limit=2) == 2  # the back end's bound still applies


# ---- rejection sampling with a deterministic draft --------------------------------------------------------


def chi_square(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def copied_draft_outputs(p: torch.Tensor, drafts: list[int], q: torch.Tensor, trials: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    outputs = []
    for _ in range(trials):
        accepted, token = accept_sampled(p, q, drafts, generator)
        outputs.append([*drafts[:accepted], token])
    return outputs


def test_a_copied_draft_verified_with_a_one_hot_q_keeps_the_target_distribution() -> None:
    vocab, trials = 6, 8_000
    generator = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, vocab, generator=generator) * 1.5, dim=-1)
    drafts = [2, 4]  # fixed: what the context held, whatever p says
    draft = Draft(torch.tensor(drafts), LOOKUP)
    q = draft_distributions(draft, vocab)
    assert torch.equal(q, torch.nn.functional.one_hot(torch.tensor(drafts), vocab).float())
    outputs = copied_draft_outputs(p, drafts, q, trials)
    assert chi_square([o[0] for o in outputs], p[0]) < CHI2_999_DOF5
    second = [o[1] for o in outputs if o[0] == drafts[0]]  # after the first draft was emitted
    assert len(second) > 800 and chi_square(second, p[1]) < CHI2_999_DOF5
    # The first draft is accepted with probability p_0(d1): min(1, p / q) with q = 1.
    accepted = sum(len(o) > 1 for o in outputs) / trials
    assert abs(accepted - float(p[0, drafts[0]])) < 0.03


def test_the_test_detects_a_copied_draft_verified_with_the_wrong_q() -> None:
    """Negative control: verifying the same fixed drafts as if drawn from p (q = p) accepts them too often."""
    vocab, trials = 6, 2_000
    generator = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, vocab, generator=generator) * 1.5, dim=-1)
    drafts = [int(p[0].argmin()), 4]
    outputs = copied_draft_outputs(p, drafts, p[:2].clone(), trials)
    assert chi_square([o[0] for o in outputs], p[0]) > CHI2_999_DOF5


def test_an_mtp_draft_continued_by_a_copy_keeps_the_target_distribution() -> None:
    """A sampled MTP draft followed by a copy chosen from it (q: the head's row, then the copy's one-hot):
    the first token follows p_0, the second (after an accepted first draft) p_1."""
    vocab, trials = 6, 8_000
    generator = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(3, vocab, generator=generator) * 1.5, dim=-1)
    q0 = torch.softmax(torch.randn(vocab, generator=generator), dim=-1)
    draws = torch.Generator().manual_seed(4)
    outputs = []
    for _ in range(trials):
        first = int(torch.multinomial(q0, 1, generator=draws))
        drafts = [first, (first * 5 + 1) % vocab]  # what the context held after the drafted token
        q = torch.stack([q0, torch.nn.functional.one_hot(torch.tensor(drafts[1]), vocab).float()])
        accepted, token = accept_sampled(p, q, drafts, draws)
        outputs.append([*drafts[:accepted], token])
    assert chi_square([o[0] for o in outputs], p[0]) < CHI2_999_DOF5
    second = [o[1] for o in outputs if len(o) > 1]
    assert len(second) > 2_000 and chi_square(second, p[1]) < CHI2_999_DOF5


class HostSequence:
    """What `DraftPolicy._extended` needs of a sequence: token ids on the (host) device."""

    def ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.long)


@pytest.mark.parametrize("sampled", [False, True])
def test_an_extended_mtp_draft_carries_one_hot_q_for_its_copy(sampled: bool) -> None:
    index = NGramIndex(2, 4)
    index.extend([3, 7, 1, 2, 6, 3, 7, 5])
    policy = DraftPolicy(DraftSettings(mode="combined", mtp_k=2, lookup_k=5, adaptive=False), index)
    vocab = 8
    probs = torch.softmax(torch.randn(2, vocab), dim=-1) if sampled else None
    head = Draft(torch.tensor([7, 1]), MTP, probs)  # context ... 3, 7, 5 then 7, 1: [7, 1] continued 2, 6, 3
    draft = policy._extended(HostSequence(), head, limit=8)  # type: ignore[arg-type]
    assert (
        draft.source == MTP
        and draft.host_tokens == [7, 1, 2, 6, 3]
        and draft.tokens.tolist() == [7, 1, 2, 6, 3]
    )
    q = draft_distributions(draft, vocab)
    expected = torch.nn.functional.one_hot(torch.tensor([7, 1, 2, 6, 3]), vocab).float()
    if probs is not None:
        expected[:2] = probs
    assert torch.equal(q, expected)
    assert policy._extended(HostSequence(), head, limit=2).k == 2  # the cycle's bound leaves no room
    policy.settings.extend_mtp = False
    assert policy._extended(HostSequence(), head, limit=8) is head


def test_a_copy_continues_from_its_source_while_the_output_follows_it() -> None:
    index = NGramIndex(2, 2)
    index.extend([1, 2, 3, 4, 5, 6, 8, 3, 4, 9, 1, 2])
    drafter = LookupDrafter(index)
    seq = HostSequence()
    assert drafter.propose(seq, 2, None, 1).host_tokens == [3]  # type: ignore[arg-type, union-attr]
    index.extend([3, 4])  # the draft accepted, then the source's next token
    # [3, 4] last occurred before 9, but the copy in progress goes on with 5, 6.
    assert index.continuation(2) == ([9, 1], 2)
    assert drafter.propose(seq, 4, None, 2).host_tokens == [5, 6]  # type: ignore[arg-type, union-attr]
    index.extend([7])  # the output left the source: back to the lookup, which has no [4, 7]
    assert drafter.propose(seq, 7, None, 2) is None  # type: ignore[arg-type]


# ---- through the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    directory: Path = write_draftable_checkpoint(tmp_path_factory.mktemp("drafting"), seed=5)
    return Engine(directory, backend="reference", device="cpu", dtype="fp32")


def copy_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts that repeat stretches of themselves (what an edit quotes), of random lengths."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        body = [rng.randrange(vocab) for _ in range(rng.randint(4, 40))]
        start = rng.randrange(len(body))
        prompts.append(body + body[start : start + rng.randint(2, 12)])
    return prompts


@pytest.mark.parametrize(
    ("drafting", "ngram", "lookup_k", "adaptive", "extend"),
    [
        ("lookup", (1, 3), 8, True, True),
        ("combined", (2, 4), 8, True, False),
        ("combined", (1, 2), 24, False, True),  # past 16 drafts: the reference verifies any length
    ],
)
def test_greedy_with_copied_drafts_equals_plain_greedy(
    engine: Engine, drafting: str, ngram: tuple[int, int], lookup_k: int, adaptive: bool, extend: bool
) -> None:
    engine.ngram, engine.lookup_k, engine.adaptive_drafts = ngram, lookup_k, adaptive
    engine.extend_mtp = extend
    accepted = drafted = 0
    sources: set[str] = set()
    longest_mtp = 0  # the longest draft a cycle started by the MTP head verified
    for prompt in copy_prompts(6, engine.config.vocab_size, seed=lookup_k):
        request = GenerateRequest(prompt, SamplingParams(temperature=0.0), max_tokens=40, ignore_eos=True)
        engine.spec_k, engine.drafting = 0, "mtp"
        plain, _ = generate_ids(engine, request)
        engine.spec_k, engine.drafting = 2, drafting
        spec, finished = generate_ids(engine, request)
        assert spec == plain, f"{drafting}: prompt {prompt}"
        usage = finished.usage
        assert usage.drafts == sum(c.drafts for c in usage.by_source.values())
        assert usage.accepted_draft_tokens == sum(c.accepted_tokens for c in usage.by_source.values())
        assert max(len(c.accepted_per_position) for c in usage.by_source.values()) <= lookup_k
        accepted += usage.accepted_draft_tokens
        drafted += usage.draft_tokens
        sources |= set(usage.by_source)
        if MTP in usage.by_source:
            longest_mtp = max(longest_mtp, len(usage.by_source[MTP].accepted_per_position))
    engine.extend_mtp = True
    assert LOOKUP in sources and (MTP in sources) == (drafting == "combined")
    assert 0 < accepted < drafted  # both the accepting and the rolling-back paths ran
    if drafting == "combined":  # MTP drafts were continued by copies exactly when asked to
        assert (longest_mtp > 2) == extend


def test_greedy_with_penalties_and_copied_drafts_equals_plain(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2)
    engine.ngram, engine.lookup_k, engine.adaptive_drafts = (1, 3), 8, True
    for prompt in copy_prompts(5, engine.config.vocab_size, seed=77):
        request = GenerateRequest(prompt, params, max_tokens=30, ignore_eos=True)
        engine.spec_k, engine.drafting = 0, "mtp"
        plain, _ = generate_ids(engine, request)
        engine.spec_k, engine.drafting = 2, "combined"
        spec, _ = generate_ids(engine, request)
        assert spec == plain


def test_a_session_turn_after_a_lookup_turn_equals_plain(engine: Engine) -> None:
    """The session's index carries over to its next turn (extended, not rebuilt) and still proposes only
    what the new context holds; the output stays plain greedy's."""
    engine.ngram, engine.lookup_k = (1, 3), 8
    prompt = copy_prompts(1, engine.config.vocab_size, seed=5)[0]
    outputs = {}
    for drafting, k in (("mtp", 0), ("combined", 2)):
        engine.spec_k, engine.drafting = k, drafting
        first, _ = generate_ids(
            engine,
            GenerateRequest(
                prompt,
                SamplingParams(temperature=0.0),
                max_tokens=12,
                ignore_eos=True,
                session_id=f"s-{drafting}",
            ),
        )
        second, _ = generate_ids(
            engine,
            GenerateRequest(
                prompt + first + prompt[:5],
                SamplingParams(temperature=0.0),
                max_tokens=20,
                ignore_eos=True,
                session_id=f"s-{drafting}",
            ),
        )
        outputs[drafting] = (first, second)
    assert outputs["combined"] == outputs["mtp"]


def test_sampling_with_copied_drafts_matches_plain_sampling_in_distribution(engine: Engine) -> None:
    """End to end, lookup drafting: the first two tokens (the second decided by verifying a copied draft:
    n = 1 on a prompt holding every token, so the first sampled token occurred before) are
    distributed alike with and without drafts (a two-sample chi-square over the frequent pairs)."""
    vocab = engine.config.vocab_size
    prompt = list(range(vocab))  # every token: whatever token one is, it occurred before
    engine.ngram, engine.lookup_k, engine.adaptive_drafts = (1, 1), 2, False
    runs = 300
    counts: dict[str, dict[tuple[int, ...], int]] = {"plain": {}, "lookup": {}}
    lookup_drafts = 0
    for mode, seen in counts.items():
        engine.spec_k, engine.drafting = (0, "mtp") if mode == "plain" else (0, "lookup")
        for seed in range(runs):
            params = SamplingParams(temperature=1.0, seed=seed)
            # One session per mode: each run restores the prompt's checkpoint instead of prefilling it.
            request = GenerateRequest(
                prompt, params, max_tokens=3, ignore_eos=True, session_id=f"dist-{mode}"
            )
            ids, finished = generate_ids(engine, request)
            seen[tuple(ids[:2])] = seen.get(tuple(ids[:2]), 0) + 1
            if mode == "lookup":
                lookup_drafts += finished.usage.by_source.get(LOOKUP, None) is not None
    assert lookup_drafts > runs // 2
    keys = [
        k
        for k in set(counts["plain"]) | set(counts["lookup"])
        if counts["plain"].get(k, 0) + counts["lookup"].get(k, 0) >= 20
    ]
    a = torch.tensor([counts["plain"].get(k, 0) for k in keys], dtype=torch.float64)
    b = torch.tensor([counts["lookup"].get(k, 0) for k in keys], dtype=torch.float64)
    chi2 = float(((a - b) ** 2 / (a + b)).sum())
    dof = len(keys) - 1
    assert dof >= 3
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3  # Wilson-Hilferty, 0.999
    assert chi2 < bound

"""Sampling parameters, their validation, and the logits pipeline (penalties, truncation, sampling)."""

from __future__ import annotations

import math

import pytest
import torch
from onestream.worker.api import SamplingParams
from onestream.worker.errors import InvalidRequestError
from onestream.worker.sampling import (
    RequestSampler,
    TokenHistory,
    apply_penalties,
    probabilities,
    sample,
)

torch.set_num_threads(1)
V = 50


def fresh_logits(rows: int = 1, seed: int | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    return torch.randn(rows, V, generator=generator) * 3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", 1e9),
        ("temperature", "hot"),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("presence_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("frequency_penalty", float("inf")),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", 11.0),
        ("seed", -1),
        ("seed", 1.5),
        ("seed", 2**64),
        ("logit_bias", ((3, 101.0),)),
        ("logit_bias", ((3, float("nan")),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logit_bias", ((V, 1.0),)),
    ],
)
def test_every_invalid_parameter_is_named(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=field):
        params.validate(vocab_size=V)


def test_defaults_and_boundaries_are_valid() -> None:
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0),
        SamplingParams(
            temperature=2.0, top_k=1, top_p=1e-3, min_p=1.0, presence_penalty=-2, frequency_penalty=2
        ),
        SamplingParams(repetition_penalty=10.0, seed=0),
    ):
        params.validate()


def naive_penalties(
    logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    """vLLM's definition, written one token at a time."""
    out = list(logits)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
        count = output.count(t)
        out[t] -= params.frequency_penalty * count + (params.presence_penalty if count else 0.0)
    return out


def test_penalties_match_their_definition() -> None:
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7)
    prompt = torch.randint(0, V, (12,), generator=generator).tolist()
    output = torch.randint(0, V, (9,), generator=generator).tolist()
    drafts = torch.randint(0, V, (3,), generator=generator).tolist()
    history = TokenHistory(prompt, V, "cpu")
    history.append(output)
    logits = fresh_logits(4)
    got = apply_penalties(logits, params, history, per_row=drafts)
    for j in range(4):  # row j also counts the first j drafts as generated
        want = naive_penalties(logits[j].tolist(), params, prompt, output + drafts[:j])
        torch.testing.assert_close(got[j], torch.tensor(want), rtol=1e-5, atol=1e-5)
    # `before` counts tokens for every row
    got_before = apply_penalties(logits[:1], params, history, before=drafts)
    want = naive_penalties(logits[0].tolist(), params, prompt, output + drafts)
    torch.testing.assert_close(got_before[0], torch.tensor(want), rtol=1e-5, atol=1e-5)
    # Drafts may stay on the device as a tensor (duplicates included): the same penalties.
    repeated = [*drafts, drafts[0]]
    as_tensor = apply_penalties(
        logits, params, history, before=torch.tensor(repeated), per_row=torch.tensor(drafts)
    )
    as_list = apply_penalties(logits, params, history, before=repeated, per_row=drafts)
    assert torch.equal(as_tensor, as_list)
    want = naive_penalties(logits[3].tolist(), params, prompt, output + repeated + drafts)
    torch.testing.assert_close(as_list[3], torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_prompt_tokens_get_only_the_repetition_penalty() -> None:
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)
    history = TokenHistory([3, 3, 4], V, "cpu")
    logits = fresh_logits()
    torch.testing.assert_close(apply_penalties(logits, params, history), logits)


def naive_truncation(probs: list[float], params: SamplingParams) -> set[int]:
    """The tokens min-p, then top-k, then top-p keep (vLLM's order), by sorting."""
    keep = set(range(len(probs)))
    top = max(probs)
    keep = {t for t in keep if probs[t] >= params.min_p * top}
    ranked = sorted(keep, key=lambda t: -probs[t])
    if params.top_k > 0:
        ranked = ranked[: params.top_k]
    total = sum(probs[t] for t in ranked)
    kept, mass = [], 0.0
    for t in ranked:
        if mass >= params.top_p * total - 1e-12 and kept:
            break
        kept.append(t)
        mass += probs[t]
    return set(kept)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.05),
        SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.02),
    ],
)
def test_truncation_keeps_what_its_definition_keeps(params: SamplingParams) -> None:
    logits = fresh_logits(3)
    got = probabilities(logits, params)
    base = torch.softmax(logits / params.temperature, dim=-1)
    for row in range(3):
        kept = naive_truncation(base[row].tolist(), params)
        assert set(torch.nonzero(got[row]).flatten().tolist()) == kept
        torch.testing.assert_close(got[row].sum(), torch.tensor(1.0))
        renormalised = base[row, sorted(kept)] / base[row, sorted(kept)].sum()
        torch.testing.assert_close(got[row, sorted(kept)], renormalised)


def test_greedy_is_a_one_hot_on_the_penalised_argmax() -> None:
    logits = fresh_logits(2)
    top = logits[0].argmax().item()
    history = TokenHistory([top], V, "cpu")
    params = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    probs = probabilities(logits, params, history)
    assert probs.sum(-1).tolist() == [1.0, 1.0]
    penalised = apply_penalties(logits, params, history)
    assert probs.argmax(-1).tolist() == penalised.argmax(-1).tolist()
    if logits[0, top] > 0 and (logits[0] > logits[0, top] / 10).sum() > 1:
        assert probs[0].argmax().item() != top  # the penalty moved the argmax away


def test_logit_bias_is_added_before_the_penalties() -> None:
    logits = fresh_logits(3)
    history = TokenHistory([4], V, "cpu")
    params = SamplingParams(logit_bias=((4, 5.0), (7, -100.0)), repetition_penalty=2.0)
    got = apply_penalties(logits, params, history)
    biased = logits.clone()
    biased[:, 4] += 5.0
    biased[:, 7] -= 100.0
    expected = torch.where(biased > 0, biased / 2.0, biased * 2.0)
    expected[:, [i for i in range(V) if i != 4]] = biased[:, [i for i in range(V) if i != 4]]
    torch.testing.assert_close(got, expected)
    greedy = SamplingParams(temperature=0.0, logit_bias=((9, 100.0),))
    assert probabilities(logits, greedy).argmax(-1).tolist() == [9, 9, 9]


def test_a_samplers_bias_is_made_once_and_a_repeated_id_keeps_its_last_value() -> None:
    logits = fresh_logits(2)
    params = SamplingParams(temperature=0.0, logit_bias=((6, 3.0), (2, -1.5), (6, 40.0)))
    sampler = RequestSampler(params, [1], V, "cpu")
    assert sampler.bias is not None and sampler.bias.ids.tolist() == [6, 2]
    expected = logits.clone()
    expected[:, 6] += 40.0
    expected[:, 2] -= 1.5
    torch.testing.assert_close(apply_penalties(logits, params, None, bias=sampler.bias), expected)
    torch.testing.assert_close(apply_penalties(logits, params, None), expected)
    assert sampler.next_tokens(logits).tolist() == [6, 6]
    assert RequestSampler(SamplingParams(), [1], V, "cpu").bias is None


def test_sample_follows_the_distribution() -> None:
    probs = torch.softmax(fresh_logits(seed=3)[:, :6], dim=-1)
    n = 40_000
    draws = sample(probs.expand(n, 6), torch.Generator().manual_seed(1))
    counts = torch.bincount(draws, minlength=6).double()
    expected = probs[0].double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.52, f"chi-square {chi2:.1f} exceeds the 0.999 quantile for 5 degrees of freedom"


def test_zero_probability_tokens_are_never_sampled() -> None:
    probs = torch.zeros(1000, V)
    probs[:, 7] = 0.25
    probs[:, 9] = 0.75
    draws = sample(probs, torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {7, 9}


def test_seeded_sampling_is_reproducible() -> None:
    logits = fresh_logits(1)
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=1234)

    def draw(p: SamplingParams) -> list[int]:
        sampler = RequestSampler(p, [1, 2, 3], V, "cpu")
        return [int(sampler.next_tokens(logits)[0]) for _ in range(50)]

    assert draw(params) == draw(params)
    assert draw(params) != draw(SamplingParams(temperature=1.5, top_p=0.95, seed=4321))


def test_sampler_commit_feeds_the_penalties() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5] = 2.0
    logits[0, 6] = 1.9
    sampler = RequestSampler(SamplingParams(temperature=0.0, presence_penalty=0.5), [], V, "cpu")
    assert int(sampler.next_tokens(logits)[0]) == 5
    sampler.commit([5])
    assert int(sampler.next_tokens(logits)[0]) == 6
    assert math.isclose(float(sampler.probabilities(logits).sum()), 1.0)

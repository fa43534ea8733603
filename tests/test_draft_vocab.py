"""Greedy drafts among the first token ids (worker/draft_vocab.py): the setting's bounds, the drafts it gives,
and greedy output unchanged by it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from onestream.worker import draft_vocab as dv
from onestream.worker.api import SamplingParams
from onestream.worker.draft_vocab import DraftVocabulary, check_draft_vocab, greedy_draft
from onestream.worker.engine import Engine, GenerateRequest
from onestream.worker.errors import InvalidRequestError
from onestream.worker.testing_spec import generate_ids, write_draftable_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def draftable_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_draftable_checkpoint(tmp_path_factory.mktemp("draftable"), seed=5)


def test_the_draft_vocabulary_is_the_prefix_that_holds_the_generated_tokens() -> None:
    """Nothing is chosen before the warm-up; then the shortest whole number of grains of ids holding the coverage
    of what was generated, and the whole vocabulary where that prefix would save too little."""
    learnt = DraftVocabulary(248320)
    generator = torch.Generator().manual_seed(1)
    common = torch.randint(0, 5000, (dv.WARMUP - 1,), generator=generator).tolist()
    assert learnt.observe(common) is None  # still warming up
    assert learnt.observe([7] * dv.EVERY) == 5 * dv.GRAIN  # 5000 < 5120
    # A few rare tokens (under 1 - coverage of all) do not move it; many do.
    assert learnt.observe([200000] * 5 + [1] * (dv.EVERY - 5)) == 5 * dv.GRAIN
    assert learnt.observe([200000] * (4 * dv.EVERY)) is None  # past GAIN of the vocabulary: all of it
    assert check_draft_vocab(learnt.rows, 248320) == 0


def test_a_fixed_draft_vocabulary_is_checked() -> None:
    assert check_draft_vocab(None, 248320) == 0
    assert check_draft_vocab(248320, 248320) == 0
    assert check_draft_vocab(32768, 248320) == 32768


@pytest.mark.parametrize("bad", [0, -8, 12, 248328])
def test_a_draft_vocabulary_the_kernel_cannot_take_names_itself(bad: int) -> None:
    with pytest.raises(InvalidRequestError, match=f"multiple of 8.*got {bad}"):
        check_draft_vocab(bad, 248320)


def test_greedy_draft_takes_the_argmax_among_the_first_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5, 9.0], [3.0, 1.0, 2.0, 0.0]])
    assert greedy_draft(logits, None).tolist() == [3, 0]
    assert greedy_draft(logits, 3).tolist() == [1, 0]


@pytest.mark.parametrize("drafting", ["mtp", "combined"])
def test_greedy_output_does_not_depend_on_the_draft_vocabulary(draftable_dir: Path, drafting: str) -> None:
    """Drafts among the first ids are rejected where the model's choice lies beyond them; the verify still
    decides every token, so greedy output equals plain greedy whatever the draft vocabulary."""
    engine = Engine(draftable_dir, backend="reference", device="cpu", dtype="fp32", drafting=drafting)
    engine.draft_vocabulary = None  # fixed below
    vocab = engine.config.vocab_size
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (20,), generator=generator).tolist() for _ in range(4)]
    accepted: dict[int | None, int] = {}
    for draft_vocab in (None, vocab // 2 // 8 * 8, 8):
        engine.backend.draft_vocab = draft_vocab
        accepted[draft_vocab] = 0
        for prompt in prompts:
            request = GenerateRequest(prompt, SamplingParams(temperature=0.0), max_tokens=24, ignore_eos=True)
            engine.spec_k = 0
            plain, _ = generate_ids(engine, request)
            engine.spec_k = 3
            spec, finished = generate_ids(engine, request)
            assert spec == plain, f"draft vocabulary {draft_vocab}, prompt {prompt}"
            accepted[draft_vocab] += finished.usage.accepted_draft_tokens
    # Eight ids leave the MTP head few right guesses: the setting reaches the drafts.
    assert accepted[8] < accepted[None]


def test_the_engine_learns_its_draft_vocabulary_from_its_output(
    draftable_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine counts what its speculative cycles generate and sets the back end's draft vocabulary from it;
    greedy output stays plain greedy's throughout."""
    monkeypatch.setattr(dv, "WARMUP", 32)
    monkeypatch.setattr(dv, "EVERY", 16)
    monkeypatch.setattr(dv, "GRAIN", 8)
    engine = Engine(draftable_dir, backend="reference", device="cpu", dtype="fp32", drafting="mtp")
    assert engine.draft_vocabulary is not None and engine.backend.draft_vocab is None
    vocab = engine.config.vocab_size
    prompt = [(5 * i + 1) % vocab for i in range(16)]
    request = GenerateRequest(prompt, SamplingParams(temperature=0.0), max_tokens=64, ignore_eos=True)
    engine.spec_k = 0
    plain, _ = generate_ids(engine, request)
    engine.spec_k = 3
    spec, _ = generate_ids(engine, request)
    assert spec == plain
    learnt = engine.draft_vocabulary
    assert learnt.seen == len(spec) - 1  # the prefill's token is not a cycle's
    assert engine.backend.draft_vocab == learnt.rows
    if learnt.rows is not None:
        ranked = sorted(spec[1:])
        assert ranked[int(len(ranked) * dv.COVERAGE) - 1] < learnt.rows

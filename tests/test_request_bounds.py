"""Bounded work for oversized prompts, without Ray: the byte bound of text and chat prompts, and
tokenization that stops as soon as a prompt cannot fit the context (a 20 MB prompt costs a few KiB)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from onestream.worker.api import PROMPT_BYTES_PER_TOKEN, GenerateRequest, max_prompt_bytes
from onestream.worker.engine import Engine
from onestream.worker.errors import ContextLengthError
from onestream.worker.testing import write_tiny_checkpoint
from onestream.worker.tokenizer import PREFIX_CUT_SLACK_TOKENS, Tokenizer, load_tokenizer

MAX_CONTEXT = 256
WORDS = ["def", " f", "(x)", ":\n", "    ", "return", " x", " +", " 1", "\n", "é", "日本", "🙂", "  ", "\t"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return load_tokenizer(model_dir)


@pytest.fixture
def rng() -> random.Random:
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed {seed}")
    return random.Random(seed)


def random_text(rng: random.Random, words: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(words))


def test_encode_at_most_is_encode_within_the_limit_and_none_beyond(
    tokenizer: Tokenizer, rng: random.Random
) -> None:
    for _ in range(40):
        text = random_text(rng, rng.randint(1, 3000))
        ids = tokenizer.encode(text)
        limit = rng.randint(1, 2 * len(ids) + 1)
        expected = ids if len(ids) <= limit else None
        assert tokenizer.encode_at_most(text, limit) == expected, (len(ids), limit)


def test_encode_at_most_does_work_bounded_by_the_limit(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded: list[int] = []
    real = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text: encoded.append(len(text)) or real(text))
    huge = "x = 1\n" * (4 << 20)  # 24 MB
    started = time.perf_counter()
    assert tokenizer.encode_at_most(huge, 100) is None
    assert time.perf_counter() - started < 1.0
    assert sum(encoded) <= 64 * (100 + PREFIX_CUT_SLACK_TOKENS), encoded


def test_the_engine_refuses_prompts_that_cannot_fit_before_tokenizing_them_whole(model_dir: Path) -> None:
    engine = Engine(model_dir, backend="reference", device="cpu", dtype="fp32", max_context=MAX_CONTEXT)
    over_bytes = "a" * (max_prompt_bytes(MAX_CONTEXT) + 1)
    for prompt in (over_bytes, [{"role": "user", "content": over_bytes}]):
        with pytest.raises(ContextLengthError, match=f"{PROMPT_BYTES_PER_TOKEN} bytes per token"):
            engine.generate(GenerateRequest(prompt=prompt, max_tokens=4))
    within_bytes = "ab " * (max_prompt_bytes(MAX_CONTEXT) // 4)  # fits the bytes, not the tokens
    for prompt in (within_bytes, [{"role": "user", "content": within_bytes}]):
        with pytest.raises(ContextLengthError, match="exceeds the context"):
            engine.generate(GenerateRequest(prompt=prompt, max_tokens=4))
    fits = engine.generate(GenerateRequest(prompt="def f(x):", max_tokens=2))
    assert [type(item).__name__ for item in fits][-1] == "Finished"

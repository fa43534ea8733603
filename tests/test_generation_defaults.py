"""What `onestream generate` does when told nothing: the checkpoint's generation_config.json sampling defaults
(read by the engine, applied to every sampling setting the user leaves out) and token healing of prompts
that end mid-token."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from onestream.worker.api import SamplingParams
from onestream.worker.engine import Engine, Finished, GenerateRequest, generation_defaults
from onestream.worker.errors import CheckpointError
from onestream.worker.loading import default_model_dir
from onestream.worker.testing import write_tiny_checkpoint
from onestream.worker.tokenizer import HealedTextDecoder, heal_prompt, load_tokenizer

from onestream.cli import main

torch.set_num_threads(1)


def set_generation_config(model_dir: Path, **values: object) -> None:
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) | values
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # flat logits (not peaked): a repetition penalty then changes greedy choices
    return write_tiny_checkpoint(tmp_path_factory.mktemp("model"), seed=random.randrange(1000), peaked=False)


def test_sampling_defaults_follow_do_sample(tmp_path: Path) -> None:
    directory = write_tiny_checkpoint(tmp_path)
    assert generation_defaults(directory) == {"temperature": 0.0}  # no sampling keys: greedy
    penalty = round(random.uniform(1.05, 1.5), 3)
    set_generation_config(directory, repetition_penalty=penalty, temperature=0.7, top_k=20, top_p=None)
    # do_sample absent: greedy whatever the temperature says; the penalty applies either way
    assert generation_defaults(directory) == {"temperature": 0.0, "top_k": 20, "repetition_penalty": penalty}
    set_generation_config(directory, do_sample=True, top_p=0.8)
    assert generation_defaults(directory) == {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "repetition_penalty": penalty,
    }
    (directory / "generation_config.json").unlink()
    assert generation_defaults(directory) == {}


def test_bad_generation_config_is_a_clear_checkpoint_error(tmp_path: Path) -> None:
    directory = write_tiny_checkpoint(tmp_path)
    set_generation_config(directory, do_sample=True, top_p=1.5)
    with pytest.raises(CheckpointError, match=r"generation_config\.json: invalid sampling default: top_p"):
        generation_defaults(directory)
    (directory / "generation_config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match=r"generation_config\.json: not readable JSON"):
        generation_defaults(directory)


def test_engine_default_sampling_puts_given_values_over_the_model_defaults(tmp_path: Path) -> None:
    directory = write_tiny_checkpoint(tmp_path)
    set_generation_config(directory, do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.2)
    engine = Engine(directory, backend="reference", device="cpu")
    assert engine.model_info()["generation_defaults"] == engine.generation_defaults
    assert engine.default_sampling() == SamplingParams(temperature=0.6, top_p=0.9, repetition_penalty=1.2)
    assert engine.default_sampling(temperature=0.0, top_p=None, top_k=5) == SamplingParams(
        temperature=0.0, top_p=0.9, top_k=5, repetition_penalty=1.2
    )


def engine_tokens(model_dir: Path, prompt: str, params: SamplingParams, max_tokens: int) -> list[int]:
    engine = Engine(model_dir, backend="reference", device="cpu")
    tokens: list[int] = []
    request = GenerateRequest(prompt, params, max_tokens=max_tokens, ignore_eos=True)
    for item in engine.generate(request):
        if not isinstance(item, Finished):
            tokens.extend(item.token_ids)
    return tokens


def test_generate_command_applies_the_model_defaults(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    temperature = round(random.uniform(0.8, 1.5), 2)
    set_generation_config(model_dir, do_sample=True, temperature=temperature, repetition_penalty=1.3)
    command = [
        "generate",
        "--model",
        str(model_dir),
        "--backend",
        "reference",
        "--device",
        "cpu",
        "--seed",
        "7",
    ]
    command += ["--prompt", "abcabc", "--max-tokens", "10", "--ignore-eos", "--json", "--no-token-healing"]
    assert main(command) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["model"]["generation_defaults"] == {"temperature": temperature, "repetition_penalty": 1.3}
    sampled = SamplingParams(temperature=temperature, repetition_penalty=1.3, seed=7)
    assert record["token_ids"] == engine_tokens(model_dir, "abcabc", sampled, 10)
    assert main([*command, "--temperature", "0", "--repetition-penalty", "1"]) == 0  # given flags win
    greedy = engine_tokens(model_dir, "abcabc", SamplingParams(temperature=0.0), 10)
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy
    assert greedy != record["token_ids"]  # near-uniform logits: sampling 10 tokens does not repeat greedy


# ---- token healing (with the embedded model's real BPE tokenizer) ------------------------------------

CODE = """import os


def read_config(path, defaults=None):
    with open(path) as f:
        values = dict(line.split("=", 1) for line in f if "=" in line)
    return {**(defaults or {}), **values}
"""


def test_heal_prompt_backs_off_a_token_the_model_knows_longer() -> None:
    tokenizer = load_tokenizer(default_model_dir())
    ids = tokenizer.encode("def fib(n):")
    healing = heal_prompt(tokenizer, ids)
    assert healing is not None and healing.prompt_ids == ids[:-1]
    texts = tokenizer.token_texts()
    assert healing.prefix == texts[ids[-1]] == "):"
    assert ids[-1] in healing.allowed_ids and tokenizer.encode("):\n")[0] in healing.allowed_ids
    assert all(texts[i].startswith("):") for i in healing.allowed_ids)
    assert heal_prompt(tokenizer, ids[-1:]) is None  # nothing left to prefill
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert heal_prompt(tokenizer, [*ids, im_end]) is None  # special tokens stay


def test_healed_decoder_drops_the_prefix_across_chunks() -> None:
    tokenizer = load_tokenizer(default_model_dir())
    ids = tokenizer.encode("):\n    return x")
    decoder = HealedTextDecoder(tokenizer.incremental_decoder(), "):\n  ")  # longer than the first token
    text = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert text == "  return x"


def test_engine_heals_prompts_cut_anywhere() -> None:
    engine = Engine(None, backend="reference", device="cpu", token_healing=True)
    texts = engine.tokenizer.token_texts()
    rng = random.Random()
    for _ in range(3):
        prompt = CODE[: rng.randrange(20, len(CODE))]
        ids = engine.tokenizer.encode(prompt)
        healing = heal_prompt(engine.tokenizer, ids)
        tokens, text = [], ""
        request = GenerateRequest(prompt, SamplingParams(temperature=0.0), max_tokens=6, ignore_eos=True)
        for item in engine.generate(request):
            if not isinstance(item, Finished):
                tokens += item.token_ids
                text += item.text
        if healing is None:
            assert prompt + text == engine.tokenizer.decode(ids + tokens)
            continue
        assert texts[tokens[0]].startswith(healing.prefix)  # token one re-chose the backed-off text
        assert prompt + text == engine.tokenizer.decode(healing.prompt_ids + tokens)  # and it is not repeated


def test_generate_command_heals_by_default(capsys: pytest.CaptureFixture) -> None:
    command = ["generate", "--backend", "reference", "--device", "cpu", "--max-tokens", "5", "--json"]
    assert main([*command, "--prompt", "def fib(n):"]) == 0
    record = json.loads(capsys.readouterr().out)
    tokenizer = load_tokenizer(default_model_dir())
    assert tokenizer.token_texts()[record["token_ids"][0]].startswith("):")
    assert record["text"] == tokenizer.decode(record["token_ids"])[len("):") :]
    assert main([*command, "--prompt", "def fib(n):", "--no-token-healing"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "def fib(n):" + plain["text"] == tokenizer.decode(
        tokenizer.encode("def fib(n):") + plain["token_ids"]
    )

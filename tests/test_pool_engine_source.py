"""Cards built from an engine source other than a checkpoint path (cluster/engine_source.py): a random model
drawn by the card itself, served through a real Ray cluster, the router and gRPC, gives the same greedy tokens
as the same source built in process; a stamped source records when each item left the engine."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
from onestream.cluster.card import CardSettings
from onestream.cluster.engine_source import (
    CheckpointSource,
    EngineSource,
    RandomModelSource,
    StampedSource,
    source_for,
)
from onestream.worker.api import Finished, GenerateRequest, SamplingParams, TokenChunk

PROMPT = list(range(10, 26))
MAX_TOKENS = 6
SOURCE = RandomModelSource("tiny", layers=2, seed=3)
STAMPS_TIMEOUT_S = 30.0


def greedy(prompt: list[int], request_id: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        prompt,
        SamplingParams(temperature=0.0),
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        request_id=request_id,
    )


def in_process_tokens(source: EngineSource, request: GenerateRequest) -> list[int]:
    engine = source.build(device="cpu", dtype="fp32")
    return [t for item in engine.generate(request) if isinstance(item, TokenChunk) for t in item.token_ids]


# ---- the sources alone ----------------------------------------------------------------------------------
def test_a_card_without_a_source_loads_its_checkpoint() -> None:
    settings = CardSettings(model_dir="/models/qwen-27b/")
    assert settings.source == CheckpointSource("/models/qwen-27b/")
    assert settings.source.label == "qwen-27b"
    assert source_for("/m", SOURCE) is SOURCE


def test_sources_travel_pickled_and_compare_by_value() -> None:
    stamped = StampedSource(SOURCE, "/tmp/stamps")
    assert pickle.loads(pickle.dumps(stamped)) == stamped  # inside CardSettings, to the actor
    assert RandomModelSource("tiny", layers=2, seed=3) == SOURCE  # a router adopts cards of equal settings
    assert RandomModelSource("tiny", layers=2, seed=4) != SOURCE
    assert isinstance(stamped, EngineSource) and isinstance(CheckpointSource("/m"), EngineSource)
    assert SOURCE.label == "random-tiny-2L-bf16"
    assert RandomModelSource(layers=3).config().num_hidden_layers == 3  # the 27B shapes, 3 layers
    with pytest.raises(ValueError, match="shape"):
        RandomModelSource("70b")


def test_a_random_source_draws_the_same_model_every_time() -> None:
    first, again = in_process_tokens(SOURCE, greedy(PROMPT)), in_process_tokens(SOURCE, greedy(PROMPT))
    assert len(first) == MAX_TOKENS and first == again
    engine = SOURCE.build(device="cpu", dtype="fp32")
    info = SOURCE.model_info(engine)
    assert info["model_name"] == SOURCE.label and info["backend"] == "reference"


def test_a_stamped_engine_writes_one_stamp_per_item(tmp_path: Path) -> None:
    source = StampedSource(SOURCE, str(tmp_path))
    engine = source.build(device="cpu", dtype="fp32")
    before = time.perf_counter()
    items = list(engine.generate(greedy(PROMPT, "stamped-1")))
    record = json.loads((tmp_path / "stamped-1.json").read_text())
    assert isinstance(items[-1], Finished)
    assert [kind for _, kind, _ in record["items"]] == ["chunk"] * (len(items) - 1) + ["finished"]
    stamps = [t for t, _, _ in record["items"]]
    assert before <= record["start"] <= stamps[0] and stamps == sorted(stamps)
    assert engine.progress > 0 and source.model_info(engine)["model_name"] == SOURCE.label  # the engine's own


def test_serve_flags_name_a_random_source() -> None:
    from onestream.cli import build_parser
    from onestream.commands.serve import random_source, run

    parser = build_parser("serve")
    args = parser.parse_args(
        ["serve", "--random-model", "27b", "--random-layers", "16", "--random-weights", "q4_k_m"]
    )
    assert random_source(args) == RandomModelSource("27b", layers=16, weights="q4_k_m")
    assert random_source(parser.parse_args(["serve"])) is None
    assert run(parser.parse_args(["serve", "--model", "/m", "--random-model", "tiny"])) == 2  # two models


# ---- served by a pool -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool_cards() -> tuple[int, ...]:
    return (1,)


@pytest.fixture(scope="module")
def stamps_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stamps")


@pytest.fixture(scope="module")
def pool_settings(stamps_dir: Path) -> dict[str, Any]:
    # model_dir stays the embedded checkpoint's (conftest's tiny one here): the router's tokenizer.
    return {"engine_source": StampedSource(SOURCE, str(stamps_dir)), "dtype": "fp32"}


def test_a_pool_serves_the_random_model_its_card_drew(client: Any, stamps_dir: Path) -> None:
    from onestream.cluster.client import make_request
    from pool_helpers import run_turn

    turn = run_turn(
        client,
        make_request(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0, request_id="pooled-1"),
    )
    assert turn.error is None and turn.finished is not None
    assert turn.token_ids == in_process_tokens(SOURCE, greedy(PROMPT))
    info = client.model_info()
    assert info.name == SOURCE.label and info.format == "random bf16" and info.backend == "reference"
    path = stamps_dir / "pooled-1.json"
    deadline = time.monotonic() + STAMPS_TIMEOUT_S  # written on the card as its stream closes
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    record = json.loads(path.read_text())
    assert sum(n for _, kind, n in record["items"] if kind == "chunk") == MAX_TOKENS

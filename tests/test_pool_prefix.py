"""Prefix routing through the real pool: a Ray cluster with 2 CPU cards, the gRPC router and real scrapes.
A second turn without a session id lands on the card holding the first (the other card is idle longer, so
placement alone would pick it) and reports its cached tokens; a new session that shares a system prompt
goes to the card holding it; the router counts its prefix hits."""

from __future__ import annotations

import random
from typing import Any

import pytest
from onestream.cluster.client import PoolClient, make_request
from onestream.cluster.server import PoolThread
from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.worker.prefixes import MIN_PREFIX_TOKENS
from onestream.worker.testing import IM_END, IM_START, special_token_id
from pool_helpers import scrape, total

pytestmark = pytest.mark.slow

CARDS = 2
WAIT_S = 180.0
START, END = special_token_id(IM_START), special_token_id(IM_END)
rng = random.Random(11)


@pytest.fixture(scope="module")
def pool_cards() -> tuple[int, ...]:
    return (CARDS,)


@pytest.fixture(scope="module")
def pool_settings() -> dict[str, Any]:
    return {"engine_options": {"max_context": 1024}, "home_wait_s": 1.0}


def tokens(n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def message(n: int) -> list[int]:
    return [START, *tokens(n - 2), END]


def run(
    client: PoolClient, prompt: list[int] | list[dict[str, str]], session: str = ""
) -> tuple[str, list[int], pb.Finished]:
    """(card id, generated ids, finished) of one turn."""
    request = make_request(prompt, session_id=session, max_tokens=8, ignore_eos=True, temperature=0.0)
    card, ids, finished = "", [], None
    for event in client.generate(request, timeout_s=WAIT_S):
        kind = event.WhichOneof("event")
        if kind == "assigned":
            card = event.assigned.card.card_id
        elif kind == "chunk":
            ids += event.chunk.token_ids
        elif kind == "finished":
            finished = event.finished
    assert finished is not None
    return card, ids, finished


def router_counter(pool: PoolThread, name: str) -> float:
    return total(scrape(pool.metrics_address), name)


def test_a_second_turn_without_a_session_id_lands_on_the_same_card(
    pool: PoolThread, client: PoolClient
) -> None:
    hits = router_counter(pool, "onestream_router_prefix_hits_total")
    first = [*message(100), *message(30), START, *tokens(2)]
    card1, out, finished1 = run(client, first)
    assert finished1.usage.cached_prompt_tokens == 0
    second = [*first, *out, END, *message(20), START, *tokens(2)]
    card2, _, finished2 = run(client, second)
    assert card2 == card1
    assert finished2.usage.cached_prompt_tokens == len(first) + len(out) - 1
    assert router_counter(pool, "onestream_router_prefix_hits_total") == hits + 1


def test_a_new_session_goes_to_the_card_holding_its_system_prompt(
    pool: PoolThread, client: PoolClient
) -> None:
    system = message(4 * MIN_PREFIX_TOKENS)
    card1, _, _ = run(client, [*system, *message(20), START, *tokens(2)], session="team-a")
    card2, _, finished = run(client, [*system, *message(25), START, *tokens(2)], session="team-b")
    assert card2 == card1
    assert finished.usage.cached_prompt_tokens == len(system)


def test_chat_prompts_route_by_prefix_through_the_routers_tokenizer(
    pool: PoolThread, client: PoolClient
) -> None:
    system = {"role": "system", "content": "You review Python code. " * 40}
    first = [system, {"role": "user", "content": "def add(a, b): return a - b"}]
    card1, _, _ = run(client, first)
    second = [
        *first,
        {"role": "assistant", "content": "return a + b"},
        {"role": "user", "content": "Fix it."},
    ]
    card2, _, finished2 = run(client, second)
    assert card2 == card1
    assert finished2.usage.cached_prompt_tokens >= MIN_PREFIX_TOKENS  # at least the system message

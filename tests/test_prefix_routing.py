"""The router's token-prefix index (cluster/prefix_index.py) and prefix routing in the policy (rule 8),
without Ray: what cards report, longest matches per scope, and where requests without a session id go."""

from __future__ import annotations

import random

from onestream.cluster.policy import (
    AFFINITY_HIT,
    MISS_NEW_SESSION,
    PREFIX_CARD_BUSY,
    PREFIX_HIT,
    PREFIX_NONE_HELD,
    Scheduler,
)
from onestream.cluster.prefix_index import BLOCK_TOKENS, PointReporter, PrefixIndex, block_hashes, point_key

rng = random.Random(7)


def tokens(n: int) -> list[int]:
    return [rng.randrange(250_000) for _ in range(n)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scheduler(cards: int = 3) -> tuple[Scheduler, Clock]:
    clock = Clock()
    s = Scheduler(clock=clock, home_wait_s=2.0)
    for i in range(cards):
        s.add_card(f"card{i}")
        clock.now += 1.0
    return s, clock


def test_block_hashes_chain_from_the_start() -> None:
    a = tokens(5 * BLOCK_TOKENS + 3)
    b = [*a[:BLOCK_TOKENS], *tokens(4 * BLOCK_TOKENS)]
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 5 and len(hb) == 5  # whole blocks only
    assert ha[0] == hb[0] and all(x != y for x, y in zip(ha[1:], hb[1:], strict=True))
    # The same block after a different start hashes differently: a hash names the whole prefix.
    c = [*tokens(BLOCK_TOKENS), *a[BLOCK_TOKENS : 2 * BLOCK_TOKENS]]
    assert block_hashes(c)[1] != ha[1]
    assert point_key(a) == ha[-1] and point_key(a[: BLOCK_TOKENS - 1]) is None


def test_the_longest_held_prefix_per_card_in_the_scope() -> None:
    system, conversation = tokens(40 * BLOCK_TOKENS), tokens(30 * BLOCK_TOKENS + 5)
    index = PrefixIndex()
    reporter = PointReporter()
    index.update("card0", reporter.report([("team", system)]).points)
    index.update("card1", reporter.report([("team", system), ("team", system + conversation)]).points)
    index.update("card2", reporter.report([("user:bob", system)]).points)
    prompt = system + conversation + tokens(100)
    assert index.matches("team", prompt) == {"card0": len(system), "card1": (70 * BLOCK_TOKENS)}
    assert index.matches("user:bob", prompt) == {"card2": len(system)}
    assert index.matches("user:alice", prompt) == {}
    assert index.matches("team", tokens(len(prompt))) == {}
    # A point as long as the whole prompt is no match: the last prompt token must still run.
    assert index.matches("team", system) == {}
    assert index.matches("team", [*system, 1]) == {"card0": len(system), "card1": len(system)}


def test_a_report_replaces_the_cards_previous_one_and_a_forgotten_card_holds_nothing() -> None:
    first, second = tokens(4 * BLOCK_TOKENS), tokens(4 * BLOCK_TOKENS)
    index = PrefixIndex()
    index.update("card0", PointReporter().report([("team", first)]).points)
    index.update("card0", PointReporter().report([("team", second)]).points)
    assert index.matches("team", [*first, 1]) == {}
    assert index.matches("team", [*second, 1]) == {"card0": len(second)}
    index.forget("card0")
    assert index.matches("team", [*second, 1]) == {} and index.cards() == 0 and index.points() == 0


def test_a_request_without_a_session_id_goes_to_the_card_holding_its_conversation() -> None:
    s, _ = scheduler()
    waiter = s.submit("r1", None, prefix={"card2": 512, "card1": 64})
    assert waiter.assignment is not None
    assert waiter.assignment.card_id == "card2" and waiter.assignment.prefix == PREFIX_HIT
    assert waiter.assignment.affinity == MISS_NEW_SESSION
    cold = s.submit("r2", None)
    assert cold.assignment is not None and cold.assignment.prefix == PREFIX_NONE_HELD


def test_a_request_without_a_session_id_waits_for_its_busy_prefix_card_then_moves() -> None:
    s, clock = scheduler()
    busy = s.submit("busy", None, prefix={"card1": 10_000})
    assert busy.assignment is not None and busy.assignment.card_id == "card1"
    waiter = s.submit("r", None, prefix={"card1": 4096})
    assert waiter.assignment is None  # holds out for card1, though card0 and card2 are free
    clock.now += 2.5
    s.dispatch()
    assert waiter.assignment is not None and waiter.assignment.prefix == PREFIX_CARD_BUSY
    # Had card1 freed within the wait, the request would have gone there.
    s.release(waiter.assignment.card_id, None)
    s.release("card1", None)
    again = s.submit("r3", None, prefix={"card1": 4096})
    assert again.assignment is not None and again.assignment.card_id == "card1"


def test_a_new_session_takes_the_free_card_with_the_longest_prefix_but_never_waits() -> None:
    s, _ = scheduler()
    occupied = s.submit("busy", None, prefix={"card0": 1})
    assert occupied.assignment is not None and occupied.assignment.card_id == "card0"
    waiter = s.submit("new", "session-a", prefix={"card0": 8192, "card2": 2048})
    assert waiter.assignment is not None
    assert waiter.assignment.card_id == "card2" and waiter.assignment.prefix == PREFIX_HIT
    s.release("card2", "session-a", bind=True)
    # Its next turn goes home: an affinity hit, not a prefix placement.
    home = s.submit("next", "session-a", prefix={"card1": 9000})
    assert home.assignment is not None and home.assignment.card_id == "card2"
    assert home.assignment.affinity == AFFINITY_HIT and home.assignment.prefix == ""


def test_a_card_that_goes_down_or_restarts_leaves_the_index() -> None:
    s, _ = scheduler()
    held = tokens(8 * BLOCK_TOKENS)
    s.prefixes.update("card1", PointReporter().report([("team", held)]).points)
    assert s.prefixes.matches("team", [*held, 1]) == {"card1": len(held)}
    s.card_down("card1")
    assert s.prefixes.matches("team", [*held, 1]) == {}
    s.prefixes.update("card1", PointReporter().report([("team", held)]).points)
    s.add_card("card1")  # back after a restart: empty
    assert s.prefixes.matches("team", [*held, 1]) == {}

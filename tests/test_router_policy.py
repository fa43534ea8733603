"""The scheduling policy (cluster/policy.py) and the fair queue, driven directly with a manual clock."""

from __future__ import annotations

import random

import grpc
import pytest
from onestream.cluster.errors import PoolError
from onestream.cluster.policy import (
    AFFINITY_HIT,
    MISS_HOME_BUSY,
    MISS_HOME_GONE,
    MISS_NEW_SESSION,
    PREFIX_NONE_HELD,
    CardPhase,
    Scheduler,
)
from onestream.cluster.queue import Assignment, Waiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(cards: int = 3, **kwargs: object) -> tuple[Scheduler, Clock]:
    clock = Clock()
    scheduler = Scheduler(clock=clock, **kwargs)  # type: ignore[arg-type]
    for i in range(cards):
        scheduler.add_card(f"card{i}")
        clock.now += 1.0  # distinct idle times: card0 has been idle longest
    return scheduler, clock


def updates(waiter: Waiter) -> list[int | Assignment]:
    items = []
    while not waiter.updates.empty():
        items.append(waiter.updates.get_nowait())
    return items


def turn(scheduler: Scheduler, session: str | None, request: str | None = None) -> Assignment:
    """Run one whole turn that gets a card at once; returns its assignment."""
    waiter = scheduler.submit(request or f"r-{random.random()}", session)
    assert waiter.assignment is not None
    scheduler.release(waiter.assignment.card_id, session, bind=True)
    return waiter.assignment


def occupy(scheduler: Scheduler, card_id: str) -> Waiter:
    """Make `card_id` busy with a one-off request, leaving the other cards as they were."""
    taken = []
    while True:
        waiter = scheduler.submit(f"occupy-{random.random()}", None)
        assert waiter.assignment is not None, "no free card left to occupy"
        if waiter.assignment.card_id == card_id:
            break
        taken.append(waiter)
    for other in taken:
        scheduler.release(other.assignment.card_id, None)
    return waiter


def test_new_sessions_spread_over_cold_cards_then_stick_to_their_home() -> None:
    scheduler, clock = make(3)
    sessions = [f"s{i}" for i in range(3)]
    first = {s: turn(scheduler, s) for s in sessions}
    assert {a.affinity for a in first.values()} == {MISS_NEW_SESSION}
    assert len({a.card_id for a in first.values()}) == 3, "each new session gets a card without warm sessions"
    for s in random.sample(sessions, 3):
        clock.now += 1.0
        again = turn(scheduler, s)
        assert again.card_id == first[s].card_id
        assert again.affinity == AFFINITY_HIT
    assert {s: scheduler.home_of(s) for s in sessions} == {s: a.card_id for s, a in first.items()}


def test_a_new_session_prefers_the_card_idle_longest_among_equally_warm_ones() -> None:
    scheduler, clock = make(2)
    a = turn(scheduler, "a")
    clock.now += 5
    b = turn(scheduler, "b")
    assert a.card_id != b.card_id
    clock.now += 5
    c = turn(scheduler, "c")
    assert c.card_id == a.card_id, "both cards hold one session; a's card has been idle longer"


def test_a_turn_waits_for_its_busy_home_then_moves_to_a_free_card() -> None:
    scheduler, clock = make(2, home_wait_s=2.0)
    home = turn(scheduler, "agent").card_id
    occupy(scheduler, home)
    assert scheduler.phase(home) == CardPhase.BUSY
    waiter = scheduler.submit("turn-2", "agent")
    assert waiter.assignment is None, "holds out for its busy home while another card is free"
    clock.now += 1.0
    scheduler.dispatch()
    assert waiter.assignment is None
    clock.now += 1.5
    scheduler.dispatch()
    assert waiter.assignment is not None
    assert waiter.assignment.card_id != home
    assert waiter.assignment.affinity == MISS_HOME_BUSY
    assert waiter.assignment.queue_wait_s == pytest.approx(2.5)


def test_a_turn_goes_home_when_its_home_frees_within_the_wait() -> None:
    scheduler, clock = make(2, home_wait_s=5.0)
    home = turn(scheduler, "agent").card_id
    occupy(scheduler, home)
    waiter = scheduler.submit("turn-2", "agent")
    assert waiter.assignment is None
    clock.now += 1.0
    scheduler.release(home, None)
    assert waiter.assignment == Assignment(card_id=home, affinity=AFFINITY_HIT, queue_wait_s=1.0)


def test_the_queue_is_fair_across_sessions_and_publishes_positions() -> None:
    scheduler, _ = make(1, queue_capacity=10)
    running = scheduler.submit("running", None)
    assert running.assignment is not None
    greedy = [scheduler.submit(f"a{i}", "a") for i in range(3)]
    polite = scheduler.submit("b0", "b")
    order = [w.request_id for w in scheduler.queue.in_service_order()]
    assert order == ["a0", "b0", "a1", "a2"], "each session's first turn before any session's second"
    assert polite.position == 2
    assert [w.position for w in greedy] == [1, 3, 4]
    served = []
    card = running.assignment.card_id
    for _ in range(4):
        scheduler.release(card, None)
        (winner,) = [w for w in [*greedy, polite] if w.assignment is not None and w.request_id not in served]
        served.append(winner.request_id)
    assert served == order
    assert updates(polite) == [2, 1, Assignment(card, MISS_NEW_SESSION, 0.0, PREFIX_NONE_HELD)]
    # a has had three turns served already: a session showing up now goes ahead of a's new backlog.
    backlog = [scheduler.submit(f"a-more{i}", "a") for i in range(3)]
    late = scheduler.submit("c0", "c")
    assert late.position == 1
    assert [w.position for w in backlog] == [2, 3, 4]


def test_a_queued_turn_whose_home_frees_goes_before_earlier_homeless_waiters() -> None:
    scheduler, clock = make(2)
    home = turn(scheduler, "agent").card_id
    other = next(c for c in ("card0", "card1") if c != home)
    scheduler.submit("busy-1", None)
    scheduler.submit("busy-2", None)
    assert all(p == CardPhase.BUSY for p in scheduler.card_phases().values())
    homeless = scheduler.submit("homeless", None)
    clock.now += 10.0  # well past home_wait: the agent's turn would take any card too
    agent = scheduler.submit("agent-2", "agent")
    scheduler.release(home, None)
    assert agent.assignment is not None and agent.assignment.card_id == home
    assert agent.assignment.affinity == AFFINITY_HIT
    assert homeless.assignment is None
    scheduler.release(other, None)
    assert homeless.assignment is not None and homeless.assignment.card_id == other


def test_a_full_queue_rejects_with_resource_exhausted() -> None:
    scheduler, _ = make(1, queue_capacity=2)
    scheduler.submit("running", None)
    scheduler.submit("q1", "s1")
    scheduler.submit("q2", "s2")
    with pytest.raises(PoolError) as rejected:
        scheduler.submit("q3", "s3")
    assert rejected.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in rejected.value.message and rejected.value.reason == "queue_full"
    assert [w.request_id for w in scheduler.queue.in_service_order()] == ["q1", "q2"]


def test_a_dead_card_loses_its_sessions_and_comes_back_cold() -> None:
    scheduler, _ = make(2)
    home = turn(scheduler, "agent").card_id
    scheduler.card_down(home)
    assert scheduler.home_of("agent") is None
    moved = turn(scheduler, "agent")
    assert moved.card_id != home and moved.affinity == MISS_HOME_GONE
    scheduler.add_card(home)  # restarted
    assert scheduler.phase(home) == CardPhase.FREE
    assert turn(scheduler, "newcomer").card_id == home, "the restarted card holds no warm session"


def test_no_healthy_card_rejects_with_unavailable() -> None:
    scheduler, _ = make(1)
    scheduler.card_down("card0")
    with pytest.raises(PoolError) as rejected:
        scheduler.submit("r", "s")
    assert rejected.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no healthy card" in rejected.value.message and rejected.value.reason == "no_cards"


def test_withdrawing_frees_a_card_that_was_assigned_but_not_used() -> None:
    scheduler, _ = make(1)
    first = scheduler.submit("first", None)
    queued = scheduler.submit("queued", "s")
    scheduler.withdraw(queued)
    assert len(scheduler.queue) == 0
    scheduler.withdraw(first)  # assigned, never used
    assert scheduler.phase("card0") == CardPhase.FREE


def test_a_retried_request_keeps_its_place_in_line() -> None:
    scheduler, _ = make(1)
    scheduler.submit("running", None)
    early = scheduler.submit("early", "a")
    scheduler.submit("late", "b")
    scheduler.withdraw(early)
    retry = scheduler.submit("early", "a", retry_of=early)
    assert [w.request_id for w in scheduler.queue.in_service_order()] == ["early", "late"]
    assert retry.position == 1


def test_idle_bindings_expire() -> None:
    scheduler, clock = make(2, session_ttl_s=60.0)
    turn(scheduler, "agent")
    clock.now += 30
    assert scheduler.home_of("agent") is not None
    clock.now += 31
    assert "agent" not in scheduler.bindings()


def test_the_queue_is_fair_across_users_first_then_their_sessions() -> None:
    scheduler, _ = make(1, queue_capacity=20)
    running = scheduler.submit("running", None)
    # alice queues one turn on each of four sessions, then a second turn on her first; bob queues one.
    alice = [scheduler.submit(f"alice-{s}", f"alice-s{s}", user="alice") for s in range(4)]
    alice.append(scheduler.submit("alice-0b", "alice-s0", user="alice"))
    bob = scheduler.submit("bob-0", "bob-s0", user="bob")
    order = [w.request_id for w in scheduler.queue.in_service_order()]
    assert order[:3] == ["alice-0", "bob-0", "alice-1"], "bob waits for one of alice's turns, not four"
    assert order[3:] == ["alice-2", "alice-3", "alice-0b"], "alice's sessions round-robin among themselves"
    assert bob.position == 2
    served = []
    card = running.assignment.card_id
    for _ in range(len(order)):
        scheduler.release(card, None)
        (winner,) = [w for w in [*alice, bob] if w.assignment is not None and w.request_id not in served]
        served.append(winner.request_id)
    assert served == order
    # alice was served last: a newcomer (carol) goes before her next turns, and bob, served long ago,
    # goes level with carol: idle time banks no credit.
    more_alice = [scheduler.submit(f"alice-more{i}", f"alice-t{i}", user="alice") for i in range(2)]
    bob_again = scheduler.submit("bob-1", "bob-s0", user="bob")
    carol = scheduler.submit("carol-0", "carol-s0", user="carol")
    order = [w.request_id for w in scheduler.queue.in_service_order()]
    assert order == ["bob-1", "carol-0", "alice-more0", "alice-more1"]
    assert (bob_again.position, carol.position) == (1, 2) and [w.position for w in more_alice] == [3, 4]


def test_a_user_over_its_queue_limit_is_rejected_with_a_retry_hint() -> None:
    scheduler, _ = make(1, queue_capacity=10, user_max_queued=2, retry_after_s=3)
    scheduler.submit("running", None, user="alice")
    scheduler.submit("a1", "s1", user="alice")
    scheduler.submit("a2", "s2", user="alice")
    with pytest.raises(PoolError) as rejected:
        scheduler.submit("a3", "s3", user="alice")
    error = rejected.value
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.reason == "user_queued"
    assert error.retry_after_s == 3 and "--user-max-queued 2" in error.message and "alice" in error.message
    scheduler.submit("b1", "s4", user="bob")  # another user still queues
    # alice holds the card already: bob, who holds nothing, goes first.
    assert [w.request_id for w in scheduler.queue.in_service_order()] == ["b1", "a1", "a2"]

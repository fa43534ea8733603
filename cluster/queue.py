"""The bounded wait queue of requests that have no card yet: fair across users, then sessions."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Assignment:
    """The card a waiting request got, and why it got that one (the affinity metric's label)."""

    card_id: str
    affinity: str  # AFFINITY_HIT or one of the miss reasons in cluster/policy.py
    queue_wait_s: float
    prefix: str = ""  # placed by prompt prefix: PREFIX_HIT or a miss reason (cluster/policy.py); "" went home


@dataclass(eq=False)
class Waiter:
    """One request waiting for a card.

    `updates` receives the request's queue position (an int, 1 = next) whenever it changes, then exactly
    one `Assignment` (or nothing, if the request is withdrawn first).
    """

    request_id: str
    session_id: str | None
    user: str | None  # the caller's user (None without API keys)
    seq: int  # arrival order; a retried request keeps its original one
    arrived: float  # monotonic seconds
    home_wait_until: float  # until when the request holds out for its busy home card
    updates: asyncio.Queue[int | Assignment] = field(default_factory=asyncio.Queue)
    position: int = 0
    assignment: Assignment | None = None
    tag: int | None = None  # fair-queuing start tag among its user's sessions (see FairQueue)
    prefix: dict[str, int] = field(default_factory=dict)  # card id -> prompt prefix tokens it holds

    @property
    def fairness_key(self) -> str:
        # One-off requests (no session) are each their own "session" for fairness.
        return self.session_id if self.session_id is not None else f"request:{self.request_id}"


@dataclass
class _UserFlows:
    """One user's share of the queue: start-time fair queuing state across its sessions."""

    finish_tag: int = 0  # the user's tag after its last served turn (fairness across users)
    virtual_time: int = 0  # the session tag of the user's last served turn
    session_end: dict[str, int] = field(default_factory=dict)  # fairness key -> end tag of its last turn


class FairQueue:
    """Waiters in service order: start-time fair queuing across users, then across each user's sessions,
    FIFO within a session.

    Sessions: each waiter gets a start tag, the later of its user's virtual time (the tag of the user's
    last served turn) and the end of its session's previous queued turn; the user's turns go by (tag,
    arrival). So a session with many queued turns is served round-robin with the user's other sessions,
    and an idle session banks no credit.

    Users: the same rule one level up. A user's k-th waiting turn (in its own order) has the user tag
    max(V, F) + k, where V is the user tag of the last turn served and F the user's tag after its own last
    served turn; service goes by (user tag, arrival). So a user with ten sessions queued takes turns with
    a user who has one, rather than getting ten turns to the other's one. With one queued turn per user
    and per session (how agents work) this is plain FIFO.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"queue capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._waiters: list[Waiter] = []  # arrival order
        self._virtual_time = 0  # user tag of the last served turn
        self._users: dict[str | None, _UserFlows] = {}

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, waiter: Waiter) -> bool:
        return any(w is waiter for w in self._waiters)

    @property
    def over_capacity(self) -> bool:
        return len(self._waiters) > self.capacity

    def queued_of(self, user: str | None) -> int:
        return sum(w.user == user for w in self._waiters)

    def push(self, waiter: Waiter) -> None:
        """Queue a waiter; one that already has a tag (a retried request) keeps its place."""
        flows = self._users.setdefault(waiter.user, _UserFlows())
        if waiter.tag is not None:  # a retry: its user's state may have been dropped since
            flows.virtual_time = max(flows.virtual_time, waiter.tag)
        else:
            start = max(flows.virtual_time, flows.session_end.get(waiter.fairness_key, 0))
            waiter.tag = start
            flows.session_end[waiter.fairness_key] = start + 1
        self._waiters.append(waiter)

    def remove(self, waiter: Waiter, *, served: bool = False) -> bool:
        for i, w in enumerate(self._waiters):
            if w is waiter:
                del self._waiters[i]
                if served:
                    self._charge(waiter)
                return True
        return False

    def in_service_order(self) -> list[Waiter]:
        by_user: dict[str | None, list[Waiter]] = {}
        for waiter in self._waiters:
            by_user.setdefault(waiter.user, []).append(waiter)
        keyed = []
        for user, waiters in by_user.items():
            start = self._user_start(user)
            waiters.sort(key=_session_order)
            keyed += [((start + k, w.seq), w) for k, w in enumerate(waiters)]
        keyed.sort(key=lambda item: item[0])
        return [w for _, w in keyed]

    def _user_start(self, user: str | None) -> int:
        flows = self._users.get(user)
        return max(self._virtual_time, flows.finish_tag if flows else 0)

    def _charge(self, waiter: Waiter) -> None:
        """A waiter got a card: one turn of service for its user and its session."""
        start = self._user_start(waiter.user)
        flows = self._users.setdefault(waiter.user, _UserFlows())
        flows.finish_tag = start + 1
        self._virtual_time = max(self._virtual_time, start)
        if waiter.tag is not None and waiter.tag > flows.virtual_time:
            flows.virtual_time = waiter.tag
            # Sessions whose queued turns all lie behind virtual time need no entry.
            flows.session_end = {k: v for k, v in flows.session_end.items() if v > flows.virtual_time}
        # Users with nothing queued and no service ahead of virtual time need no entry either.
        waiting = {w.user for w in self._waiters}
        for user in [
            u for u, f in self._users.items() if u not in waiting and f.finish_tag <= self._virtual_time
        ]:
            del self._users[user]


def _session_order(waiter: Waiter) -> tuple[int, int]:
    return (waiter.tag or 0, waiter.seq)

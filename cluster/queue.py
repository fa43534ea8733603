"""The bounded wait queue of requests that have no card yet, FIFO and fair across sessions."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Assignment:
    """The card a waiting request got, and why it got that one (the affinity metric's label)."""

    card_id: str
    affinity: str  # AFFINITY_HIT or one of the miss reasons in cluster/policy.py
    queue_wait_s: float


@dataclass(eq=False)
class Waiter:
    """One request waiting for a card.

    `updates` receives the request's queue position (an int, 1 = next) whenever it changes, then exactly
    one `Assignment` (or nothing, if the request is withdrawn first).
    """

    request_id: str
    session_id: str | None
    seq: int  # arrival order; a retried request keeps its original one
    arrived: float  # monotonic seconds
    home_wait_until: float  # until when the request holds out for its busy home card
    updates: asyncio.Queue[int | Assignment] = field(default_factory=asyncio.Queue)
    position: int = 0
    assignment: Assignment | None = None
    tag: int | None = None  # fair-queuing start tag (see FairQueue)

    @property
    def fairness_key(self) -> str:
        # One-off requests (no session) are each their own "session" for fairness.
        return self.session_id if self.session_id is not None else f"request:{self.request_id}"


class FairQueue:
    """Waiters in service order: start-time fair queuing across sessions, FIFO within a session.

    Each waiter gets a start tag: the later of the queue's virtual time (the tag of the last waiter
    served) and the end of its session's previous queued turn; service goes by (tag, arrival). So a
    session with many queued turns is served round-robin with everyone else, a session arriving fresh
    starts level with the turn being served, and an idle session banks no credit. With one turn per
    session in flight (how agents work) this is plain FIFO.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"queue capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._waiters: list[Waiter] = []
        self._virtual_time = 0
        self._session_end: dict[str, int] = {}  # fairness key -> end tag of its last queued turn

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, waiter: Waiter) -> bool:
        return any(w is waiter for w in self._waiters)

    @property
    def over_capacity(self) -> bool:
        return len(self._waiters) > self.capacity

    def push(self, waiter: Waiter) -> None:
        """Queue a waiter; one that already has a tag (a retried request) keeps its place."""
        if waiter.tag is None:
            start = max(self._virtual_time, self._session_end.get(waiter.fairness_key, 0))
            waiter.tag = start
            self._session_end[waiter.fairness_key] = start + 1
        self._waiters.append(waiter)
        self._waiters.sort(key=_service_key)

    def remove(self, waiter: Waiter, *, served: bool = False) -> bool:
        for i, w in enumerate(self._waiters):
            if w is waiter:
                del self._waiters[i]
                if served and waiter.tag is not None and waiter.tag > self._virtual_time:
                    self._virtual_time = waiter.tag
                    # Sessions whose queued turns all lie behind virtual time need no entry.
                    self._session_end = {k: v for k, v in self._session_end.items() if v > self._virtual_time}
                return True
        return False

    def in_service_order(self) -> list[Waiter]:
        return list(self._waiters)


def _service_key(waiter: Waiter) -> tuple[int, int]:
    return (waiter.tag or 0, waiter.seq)

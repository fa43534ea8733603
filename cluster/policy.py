"""Which card serves which turn: the pool's scheduling policy.

Every card runs one generation at a time. The router keeps, for each session, its *home*: the card that
served its last turn and so holds its cache (the engine's session state: KV caches, DeltaNet state, token
history). A turn sent anywhere else re-prefills its whole prompt; a turn sent home prefills only what is
new. The policy, in order:

1. A turn whose home card is free goes home (an affinity *hit*).
2. A new session, a request without a session id or a session whose home died goes to a free card,
   preferring the card holding the fewest warm sessions (then the one idle longest), so that sessions
   spread out and keep their caches (miss reasons `new_session`, `home_gone`); but see rule 8.
3. A turn whose home card is busy waits up to `home_wait_s` for it. If its home frees in that time it
   goes home; after that it takes any free card and re-prefills there (miss reason `home_busy`), rather
   than leave the pool idle while it waits.
4. When no suitable card is free, the turn waits in a bounded queue and is told its position. Service
   order is FIFO, round-robin across users, then across each user's sessions (see cluster/queue.py). When a card frees, queued turns
   whose home it is are served first (their cache is there), then the rest in service order. A request
   can be passed over this way only by turns already queued for that card, so nobody starves.
5. A full queue, or a user with `user_max_queued` turns already waiting, rejects with
   RESOURCE_EXHAUSTED (with a retry hint); a pool with no healthy card rejects with UNAVAILABLE.
   Waiters leave the queue when cancelled, aborted or past their deadline.
6. A card that dies or hangs goes DOWN: its sessions lose their home (their next turn is placed by
   rule 2), and it rejoins as FREE with no warm sessions once its actor has restarted.
7. Bindings unused for `session_ttl_s` are forgotten.
8. Prefixes (cluster/prefix_index.py: what each card reports holding). A request without a session id
   treats the live card holding the longest prefix of its prompt as its home (rules 1 and 3: it is
   usually the same conversation's previous turn, sent again in full). A turn with no live home (a new
   session, a request without a session id whose prefix card stays busy) goes to the free card holding
   the longest prefix of its prompt, else by rule 2. Prefix outcomes: `hit` (placed on a card holding a
   prefix), misses `none_held` (no card holds one) and `card_busy` (the cards holding one were busy).

The scheduler is pure asyncio state (no Ray, no gRPC): cluster/router.py calls `submit`, `withdraw` and
`release` around each turn; cluster/cards.py reports cards coming and going.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from .errors import NO_CARDS, QUEUE_FULL, USER_QUEUED, PoolError
from .prefix_index import PrefixIndex
from .queue import Assignment, FairQueue, Waiter

AFFINITY_HIT = "hit"
MISS_NEW_SESSION = "new_session"
MISS_HOME_BUSY = "home_busy"
MISS_HOME_GONE = "home_gone"
PREFIX_HIT = "hit"
PREFIX_NONE_HELD = "none_held"
PREFIX_CARD_BUSY = "card_busy"


class CardPhase(enum.Enum):
    FREE = "free"
    BUSY = "busy"
    DOWN = "down"


@dataclass
class _Card:
    phase: CardPhase
    idle_since: float


@dataclass
class SessionBinding:
    card_id: str
    turns: int
    last_used: float  # monotonic
    last_used_wall: float  # unix seconds, for listings


class Scheduler:
    """Card states, session homes and the wait queue; every method runs on the router's event loop."""

    def __init__(
        self,
        *,
        queue_capacity: int = 256,
        home_wait_s: float = 2.0,
        session_ttl_s: float = 6 * 3600.0,
        user_max_queued: int | None = None,
        retry_after_s: int = 2,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.queue = FairQueue(queue_capacity)
        self.home_wait_s = home_wait_s
        self.session_ttl_s = session_ttl_s
        self.user_max_queued = user_max_queued
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._on_change = on_change or (lambda: None)
        self._cards: dict[str, _Card] = {}
        self._bindings: dict[str, SessionBinding] = {}
        self._homeless: set[str] = set()  # sessions whose home died; their next turn is a home_gone miss
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self.prefixes = PrefixIndex()  # what each card reports holding (rule 8)

    # ---- cards ----------------------------------------------------------------------------------
    def add_card(self, card_id: str) -> None:
        """A card that is ready to serve (new, or back after a restart with an empty cache)."""
        self._cards[card_id] = _Card(CardPhase.FREE, self._clock())
        self.prefixes.forget(card_id)
        self.dispatch()

    def card_down(self, card_id: str) -> None:
        """The card died or hung: it serves nothing until `add_card` again; its sessions lose their home."""
        card = self._cards.get(card_id)
        if card is None:
            return
        card.phase = CardPhase.DOWN
        self._unbind_card(card_id)
        self.dispatch()

    def remove_card(self, card_id: str) -> None:
        """The card left the pool (its node went away)."""
        if self._cards.pop(card_id, None) is not None:
            self._unbind_card(card_id)
            self.dispatch()

    def phase(self, card_id: str) -> CardPhase | None:
        card = self._cards.get(card_id)
        return card.phase if card else None

    def card_phases(self) -> dict[str, CardPhase]:
        return {card_id: card.phase for card_id, card in self._cards.items()}

    @property
    def has_healthy_card(self) -> bool:
        return any(c.phase != CardPhase.DOWN for c in self._cards.values())

    # ---- sessions -------------------------------------------------------------------------------
    def home_of(self, session_id: str) -> str | None:
        binding = self._bindings.get(session_id)
        return binding.card_id if binding else None

    def bindings(self) -> dict[str, SessionBinding]:
        self._expire_bindings()
        return dict(self._bindings)

    def adopt_session(self, session_id: str, card_id: str, last_used_wall: float) -> None:
        """A session an adopted card already caches (a restarted router learns its homes from its cards):
        bound there unless a copy used more recently is bound elsewhere. Its turn count starts again."""
        current = self._bindings.get(session_id)
        if current is not None and current.last_used_wall >= last_used_wall:
            return
        idle_s = max(time.time() - last_used_wall, 0.0)
        self._bindings[session_id] = SessionBinding(
            card_id=card_id, turns=0, last_used=self._clock() - idle_s, last_used_wall=last_used_wall
        )
        self._on_change()

    def forget_session(self, session_id: str) -> None:
        self._bindings.pop(session_id, None)
        self._homeless.discard(session_id)
        self._on_change()

    # ---- requests -------------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        session_id: str | None,
        *,
        user: str | None = None,
        retry_of: Waiter | None = None,
        prefix: dict[str, int] | None = None,
    ) -> Waiter:
        """Queue a request (assigning it at once when a card fits). A retry (`retry_of`, the waiter of
        the failed attempt) keeps its place in line. Raises PoolError when the pool has no healthy card,
        the queue is full or `user` has `user_max_queued` requests waiting already."""
        if not self.has_healthy_card:
            down = sum(c.phase == CardPhase.DOWN for c in self._cards.values())
            raise PoolError(
                grpc.StatusCode.UNAVAILABLE,
                f"no healthy card in the pool ({len(self._cards)} cards, {down} down)",
                NO_CARDS,
            )
        self._expire_bindings()
        now = self._clock()
        waiter = Waiter(
            request_id=request_id,
            session_id=session_id,
            user=user,
            seq=next(self._seq) if retry_of is None else retry_of.seq,
            arrived=now,
            home_wait_until=now + self.home_wait_s,
            tag=None if retry_of is None else retry_of.tag,
            prefix=dict(prefix or {}),
        )
        self.queue.push(waiter)
        self.dispatch()
        if waiter.assignment is None:
            rejection = self._over_queue_limit(waiter, retry_of is not None)
            if rejection is not None:
                self.queue.remove(waiter)
                self.dispatch()
                raise rejection
        return waiter

    def _over_queue_limit(self, waiter: Waiter, retry: bool) -> PoolError | None:
        limit = self.user_max_queued
        if limit is not None and waiter.user is not None and not retry:
            queued = self.queue.queued_of(waiter.user)
            if queued > limit:
                return PoolError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"user {waiter.user} already has {queued - 1} requests waiting for a card, the most "
                    f"a user may have queued (--user-max-queued {limit}); retry in {self.retry_after_s}s",
                    USER_QUEUED,
                    retry_after_s=self.retry_after_s,
                )
        if self.queue.over_capacity:
            return PoolError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request queue is full ({self.queue.capacity} requests waiting for a card); "
                f"retry in {self.retry_after_s}s",
                QUEUE_FULL,
                retry_after_s=self.retry_after_s,
            )
        return None

    def withdraw(self, waiter: Waiter) -> None:
        """The request left (cancelled, aborted, past its deadline) before using a card. A card it was
        assigned but never used is freed again."""
        if self.queue.remove(waiter):
            self.dispatch()
        elif waiter.assignment is not None:
            self.release(waiter.assignment.card_id, None)

    def release(self, card_id: str, session_id: str | None, *, bind: bool = False) -> None:
        """The turn on `card_id` ended. With `bind`, the card now holds `session_id`'s cache."""
        card = self._cards.get(card_id)
        now = self._clock()
        if card is not None and card.phase == CardPhase.BUSY:
            card.phase = CardPhase.FREE
            card.idle_since = now
        if bind and session_id is not None and card is not None and card.phase != CardPhase.DOWN:
            previous = self._bindings.get(session_id)
            self._bindings[session_id] = SessionBinding(
                card_id=card_id,
                turns=(previous.turns if previous else 0) + 1,
                last_used=now,
                last_used_wall=time.time(),
            )
            self._homeless.discard(session_id)
        self.dispatch()

    # ---- the policy -----------------------------------------------------------------------------
    def _live_home(self, session_id: str | None) -> str | None:
        if session_id is None:
            return None
        binding = self._bindings.get(session_id)
        if binding is None:
            return None
        card = self._cards.get(binding.card_id)
        return binding.card_id if card is not None and card.phase != CardPhase.DOWN else None

    def _warm_sessions(self) -> dict[str, int]:
        warm = dict.fromkeys(self._cards, 0)
        for binding in self._bindings.values():
            if binding.card_id in warm:
                warm[binding.card_id] += 1
        return warm

    def _prefix_home(self, waiter: Waiter) -> str | None:
        """For a request without a session id, the live card holding the longest prefix of its prompt."""
        if waiter.session_id is not None:
            return None
        live = [(n, cid) for cid, n in waiter.prefix.items() if self.phase(cid) not in (None, CardPhase.DOWN)]
        return max(live)[1] if live else None

    def dispatch(self) -> None:
        """Hand free cards to waiters by the policy; publish queue positions."""
        now = self._clock()
        free = {cid for cid, c in self._cards.items() if c.phase == CardPhase.FREE}
        if free and len(self.queue):
            waiting = self.queue.in_service_order()
            # Pass 1: queued turns whose home (or prefix home) is free go home.
            for waiter in waiting:
                home = self._live_home(waiter.session_id)
                if home in free:
                    self._assign(waiter, home, AFFINITY_HIT, now)
                    free.discard(home)
                    continue
                home = self._prefix_home(waiter) if home is None else None
                if home in free:
                    self._assign(waiter, home, self._miss_reason(waiter, None), now)
                    free.discard(home)
            # Pass 2: the rest, in service order, to the free card holding the longest prefix, else the
            # coldest.
            warm = self._warm_sessions()
            for waiter in waiting:
                if not free:
                    break
                if waiter.assignment is not None:
                    continue
                home = self._live_home(waiter.session_id) or self._prefix_home(waiter)
                if home is not None and now < waiter.home_wait_until:
                    continue  # still holding out for its busy home
                held = {cid: n for cid, n in waiter.prefix.items() if cid in free}
                if held:
                    card_id = max(held, key=lambda cid: (held[cid], -warm[cid], cid))
                else:
                    card_id = min(free, key=lambda cid: (warm[cid], self._cards[cid].idle_since, cid))
                self._assign(
                    waiter, card_id, self._miss_reason(waiter, self._live_home(waiter.session_id)), now
                )
                free.discard(card_id)
        self._publish_positions()
        self._arm_home_wait_timer(now)
        self._on_change()

    def _miss_reason(self, waiter: Waiter, home: str | None) -> str:
        if home is not None:
            return MISS_HOME_BUSY
        if waiter.session_id in self._homeless:
            return MISS_HOME_GONE
        return MISS_NEW_SESSION

    def _assign(self, waiter: Waiter, card_id: str, affinity: str, now: float) -> None:
        self.queue.remove(waiter, served=True)
        self._cards[card_id].phase = CardPhase.BUSY
        if waiter.session_id is not None:
            self._homeless.discard(waiter.session_id)
        if affinity == AFFINITY_HIT:
            prefix = ""
        elif waiter.prefix.get(card_id, 0) > 0:
            prefix = PREFIX_HIT
        else:
            prefix = PREFIX_CARD_BUSY if waiter.prefix else PREFIX_NONE_HELD
        waiter.assignment = Assignment(
            card_id=card_id, affinity=affinity, queue_wait_s=now - waiter.arrived, prefix=prefix
        )
        waiter.updates.put_nowait(waiter.assignment)

    def _publish_positions(self) -> None:
        for position, waiter in enumerate(self.queue.in_service_order(), start=1):
            if waiter.position != position:
                waiter.position = position
                waiter.updates.put_nowait(position)

    def _arm_home_wait_timer(self, now: float) -> None:
        """Wake up when the first waiter stops holding out for its busy home, if a card is free then."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending = [
            w.home_wait_until
            for w in self.queue.in_service_order()
            if w.home_wait_until > now and (self._live_home(w.session_id) or self._prefix_home(w)) is not None
        ]
        if not pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on a loop (unit use): callers dispatch by hand
        self._timer = loop.call_later(min(pending) - now + 1e-3, self.dispatch)

    def _unbind_card(self, card_id: str) -> None:
        self.prefixes.forget(card_id)
        for session_id, binding in list(self._bindings.items()):
            if binding.card_id == card_id:
                del self._bindings[session_id]
                self._homeless.add(session_id)

    def _expire_bindings(self) -> None:
        horizon = self._clock() - self.session_ttl_s
        for session_id, binding in list(self._bindings.items()):
            if binding.last_used < horizon:
                del self._bindings[session_id]
        # The homeless set only labels one miss; bound it so it cannot grow without end.
        if len(self._homeless) > 100_000:
            self._homeless.clear()

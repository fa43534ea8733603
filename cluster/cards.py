"""The card registry: one card actor per GPU (or CPU card slot) of every live Ray node, kept healthy.

- Discovery: every `discovery_interval_s` it reads `ray.nodes()`; a node offering card slots (GPUs, or
  the `onestream_cpu_card` resource for CPU cards) gets one actor per slot, pinned to that node. A node
  that joins while serving has its cards added; a node that leaves has its cards removed.
- Liveness from progress: every card, busy or free, is pinged every `health_interval_s`; its answer
  carries the engine's progress counter (model calls: prefill chunks, decode steps). A card that does
  not answer within `stall_timeout_s`, or that is busy and made no progress for that long, is down; a
  long prefill progresses chunk by chunk, so it is not. The router reports cards that die mid-stream,
  and streams on a card that went down end at once. A failed card goes DOWN in the scheduler (its
  sessions lose their home); a hung one is killed so that Ray restarts it; once the restarted actor
  answers `ready`, the card rejoins.
  An actor out of restarts is dropped and its slot refilled by discovery.
- Cards outlive the router: each is a detached actor named after its slot (`card_actor_name`). A
  router that starts where cards already run adopts them, with the sessions they cache and their
  owners, when they run its settings (otherwise it replaces them); stopping a router leaves its cards
  running.
- Every call to an actor has a timeout. Generations do not go through Ray: each card that comes up gets a
  `CardLink` (cluster/card_link.py) to its incarnation, closed when the card goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .card import (
    CPU_CARD_RESOURCE,
    NODE_ID_CHARS,
    CardActor,
    CardIdentity,
    CardLiveness,
    CardSettings,
    SessionRecord,
)
from .card_link import CardLink
from .config import PoolConfig
from .policy import Scheduler

log = logging.getLogger(__name__)

STARTING, UP, RECOVERING = "starting", "up", "recovering"
RECREATE_BACKOFF_S = 10.0  # before refilling a slot whose actor died for good
REPLACE_BACKOFF_S = 2.0  # before refilling a slot whose running card could not be adopted
# A killed card's process still answering, or nothing answering, this long after the kill may mean the signal
# was lost (its task never ran on the node): it is sent again, a few times only (pids are reused, in the end).
KILL_RESEND_S = 10.0
KILL_RESENDS = 3


class LoadBoard:
    """Where starting cards post how far their engine's weights have loaded (a Ray actor of the registry's: a
    card cannot answer its own calls until its constructor, which loads the engine, returns)."""

    def __init__(self) -> None:
        self._fractions: dict[str, float] = {}

    def report(self, key: str, fraction: float) -> None:
        self._fractions[key] = fraction

    def fractions(self) -> dict[str, float]:
        return dict(self._fractions)


@dataclass
class CardRecord:
    """One card slot: a node and the slot's index on it, the actor serving it, and what we know of it."""

    node_id: str
    slot: int
    actor: Any  # ray ActorHandle
    state: str = STARTING
    identity: CardIdentity | None = None
    restarts: int = 0
    failure: str | None = None  # why it went down (streams on it end with this)
    progress: int = -1  # the engine's progress counter at the last ping
    progress_at: float = 0.0  # monotonic time the counter last moved (or the card was last idle)
    adopted: bool = False  # found running (a previous router's): this router takes it over
    link: CardLink | None = field(default=None, repr=False)  # to the incarnation in `identity`
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[str, int]:
        return (self.node_id, self.slot)

    @property
    def load_key(self) -> str:
        """The key the card's load progress is posted under (LoadBoard)."""
        return f"{self.node_id}/{self.slot}"

    @property
    def card_id(self) -> str:
        if self.identity is not None:
            return self.identity.card_id
        return f"{self.node_id[:NODE_ID_CHARS]}/{self.slot}/starting"


class CardRegistry:
    def __init__(
        self,
        config: PoolConfig,
        scheduler: Scheduler,
        on_change: Callable[[], None],
        on_card_up: Callable[[str], None] | None = None,
        on_sessions_adopted: Callable[[list[SessionRecord]], None] | None = None,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self._on_change = on_change
        self._on_card_up = on_card_up  # a card (by id) starts serving: its per-card series can be exported
        self._on_sessions_adopted = on_sessions_adopted  # the sessions an adopted card caches, with owners
        self._records: dict[tuple[str, int], CardRecord] = {}
        self._by_card: dict[str, CardRecord] = {}
        self._dead_slots: dict[tuple[str, int], float] = {}  # slot -> monotonic time it may be refilled
        self._loops: list[asyncio.Task[None]] = []
        self._card_ready = asyncio.Event()
        self.model_info: dict[str, Any] | None = None
        self._sd_snapshot: list[dict[str, Any]] = []
        self._load_board: Any = None  # ray ActorHandle of a LoadBoard
        self._started_at: float | None = None  # monotonic, once the first look at the cluster is done
        self._closing: set[asyncio.Future[None]] = set()  # links being closed

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._load_board = (
            ray.remote(LoadBoard).options(num_cpus=0, namespace=self.config.ray_namespace).remote()
        )
        await self.discover()
        self._started_at = time.monotonic()
        self._loops = [
            asyncio.create_task(
                self._every(self.config.discovery_interval_s, self.discover), name="card-discovery"
            ),
            asyncio.create_task(
                self._every(self.config.health_interval_s, self.check_health), name="card-health"
            ),
        ]

    async def wait_until_ready(self, count: int, timeout_s: float) -> None:
        """Wait until `count` cards serve (and the model info is known)."""
        deadline = time.monotonic() + timeout_s
        while len(self.live_cards()) < count or self.model_info is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{len(self.live_cards())} of {count} cards ready after {timeout_s:.0f}s; "
                    f"cards: {[(r.card_id, r.state) for r in self._records.values()]}"
                )
            self._card_ready.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._card_ready.wait(), min(remaining, 1.0))

    async def stop(self) -> None:
        """Stop watching the cards; they keep running (detached) for the next router to adopt."""
        for task in self._loops:
            task.cancel()
        for record in list(self._records.values()):
            self._drop(record, kill=False)
        await asyncio.gather(*self._loops, *self._closing, return_exceptions=True)
        self._loops = []
        if self._load_board is not None:
            with contextlib.suppress(Exception):
                ray.kill(self._load_board)
            self._load_board = None

    async def loading_fractions(self) -> dict[str, float]:
        """How far each card slot's weights have loaded, by `CardRecord.load_key` (empty if unknown). A slot
        whose node has left is not reported: its last post stays on the board."""
        if self._load_board is None:
            return {}
        try:
            posted = await asyncio.wait_for(self._load_board.fractions.remote(), self.config.call_timeout_s)
        except (RayError, asyncio.TimeoutError):
            return {}
        slots = {record.load_key for record in self._records.values()}
        return {key: fraction for key, fraction in posted.items() if key in slots}

    async def _every(self, interval_s: float, step: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await step()
            except Exception:
                log.exception("card registry: %s failed", getattr(step, "__name__", step))

    # ---- discovery ------------------------------------------------------------------------------
    def _slots(self, node: dict[str, Any]) -> int:
        resources = node.get("Resources") or {}
        name = CPU_CARD_RESOURCE if self.config.cpu_cards is not None else "GPU"
        return int(resources.get(name, 0))

    async def discover(self) -> None:
        nodes = await asyncio.to_thread(ray.nodes)
        alive = {n["NodeID"]: n for n in nodes if n.get("Alive")}
        for record in list(self._records.values()):
            if record.node_id not in alive:
                log.warning("card %s: node %s left the cluster", record.card_id, record.node_id)
                self._drop(record, kill=True)
        self._dead_slots = {k: t for k, t in self._dead_slots.items() if k[0] in alive}
        now = time.monotonic()
        for node_id, node in alive.items():
            for slot in range(self._slots(node)):
                key = (node_id, slot)
                if key in self._records or self._dead_slots.get(key, 0.0) > now:
                    continue
                self._dead_slots.pop(key, None)
                await self._adopt_or_create(node_id, slot)

    async def _adopt_or_create(self, node_id: str, slot: int) -> None:
        """Adopt the card a previous router left running in this slot (detached actors outlive their
        router), or create one."""
        settings = self._card_settings(slot)
        name = card_actor_name(node_id, slot)
        actor = await asyncio.to_thread(_named_actor, name, self.config.ray_namespace)
        if (node_id, slot) in self._records:
            return
        adopting = settings if actor is not None else None
        if actor is None:
            actor = self._create(node_id, slot, settings)
            log.info("card slot %s/%d: actor created", node_id[:NODE_ID_CHARS], slot)
        else:
            log.info("card slot %s/%d: adopting the running card %s", node_id[:NODE_ID_CHARS], slot, name)
        record = CardRecord(node_id=node_id, slot=slot, actor=actor, adopted=adopting is not None)
        self._records[record.key] = record
        self._start_bring_up(record, adopting=adopting)
        self._changed()

    def adopting(self) -> bool:
        """True while this router may not know every running card's sessions and their owners yet: until
        its first look at the cluster, and while a card it found running is not up, for at most
        `call_timeout_s` after that look (a card that answers no sooner is being replaced, not awaited)."""
        if self._started_at is None:
            return True
        if time.monotonic() - self._started_at > self.config.call_timeout_s:
            return False
        return any(r.adopted and r.state == STARTING for r in self._records.values())

    def _card_settings(self, slot: int) -> CardSettings:
        cpu = self.config.cpu_cards is not None
        return CardSettings(
            model_dir=str(self.config.model_dir),
            cpu=cpu,
            slot=slot,
            backend=self.config.backend,
            dtype=self.config.dtype,
            torch_threads=self.config.card_torch_threads,
            metrics_host=self.config.card_metrics_host,
            engine_options={**self.config.engine_options, "prefix_sharing": self.config.prefix_sharing},
            engine_source=self.config.engine_source,
        )

    def _create(self, node_id: str, slot: int, settings: CardSettings) -> Any:
        placement: dict[str, Any] = {"resources": {CPU_CARD_RESOURCE: 1}} if settings.cpu else {"num_gpus": 1}
        return (
            ray.remote(CardActor)
            .options(
                name=card_actor_name(node_id, slot),
                lifetime="detached",  # cards outlive the router: a restarted one adopts them
                num_cpus=0,
                **placement,
                max_restarts=self.config.max_restarts,
                max_task_retries=0,  # a generation is at most once; the router decides on retries
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                namespace=self.config.ray_namespace,
            )
            .remote(settings, self._load_board)
        )

    def _start_bring_up(self, record: CardRecord, **how: Any) -> None:
        """`_bring_up` in the background. Should it fail itself (a bug), the card is given up, so that its
        slot is refilled rather than left down with nobody told."""
        task = asyncio.create_task(self._bring_up(record, self.config.card_start_timeout_s, **how))
        task.add_done_callback(lambda done: self._bring_up_ended(record, done))
        record.task = task

    def _bring_up_ended(self, record: CardRecord, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None or self._records.get(record.key) is not record:
            return
        error = task.exception()
        log.error("card %s: bringing it up failed", record.card_id, exc_info=error)
        self._give_up(record, f"could not be brought up ({type(error).__name__}: {error})")

    async def _bring_up(
        self,
        record: CardRecord,
        timeout_s: float,
        *,
        replacing: CardIdentity | None = None,
        adopting: CardSettings | None = None,
    ) -> None:
        """Wait for the (re)started actor to answer `ready`, then put the card in the scheduler. With
        `replacing` (the incarnation of a process we killed), only a new incarnation counts: the old
        process may still answer for a moment before the kill lands. Should it still answer, or nothing
        answer, KILL_RESEND_S after the kill, the kill is sent again (KILL_RESENDS times at most): a lost
        signal must not leave the card down until the deadline. With `adopting` (the settings this router would
        start the card with), a card a previous router left running is taken over."""
        deadline = time.monotonic() + timeout_s
        killed_at, resends = time.monotonic(), 0
        while True:
            left = deadline - time.monotonic()
            try:
                identity: CardIdentity = await asyncio.wait_for(
                    record.actor.ready.remote(),
                    max(min(left, KILL_RESEND_S) if replacing is not None else left, 0.1),
                )
                if replacing is None or identity.incarnation != replacing.incarnation:
                    break
            except ActorUnavailableError:  # restarting
                pass
            except RayError as e:  # died for good, or cannot be placed
                self._give_up(record, f"died while starting: {_first_line(e)}")
                return
            except asyncio.TimeoutError:
                if replacing is None or time.monotonic() > deadline:
                    self._give_up(record, f"did not start within {timeout_s:.0f}s")
                    return
                # No answer: a new process loading its model, or the old one frozen with its kill lost.
            # Restarting, or the killed process answered before its kill landed: ask again shortly.
            if time.monotonic() > deadline:
                self._give_up(record, f"did not come back within {timeout_s:.0f}s")
                return
            if (
                replacing is not None
                and resends < KILL_RESENDS
                and time.monotonic() - killed_at > KILL_RESEND_S
            ):
                # Harmless where the old process is gone: there is no such process.
                log.info(
                    "card %s: not back %.0fs after its kill; sending it again", record.card_id, KILL_RESEND_S
                )
                _kill_on_node(replacing.node_id, replacing.pid)
                killed_at, resends = time.monotonic(), resends + 1
            await asyncio.sleep(0.5)
        if self.model_info is None:
            with contextlib.suppress(Exception):
                self.model_info = await asyncio.wait_for(
                    record.actor.model_info.remote(), self.config.call_timeout_s
                )
        if record.key not in self._records:
            return  # dropped meanwhile
        sessions: list[SessionRecord] = []
        if adopting is not None:
            try:
                sessions = await self._take_over(record, adopting)
            except (RayError, asyncio.TimeoutError, ValueError) as e:
                log.warning("card %s cannot be adopted (%s); replacing it", identity.card_id, e)
                self._dead_slots[record.key] = time.monotonic() + REPLACE_BACKOFF_S
                self._drop(record, kill=True)
                return
        if record.identity is not None and record.identity.card_id != identity.card_id:
            self._by_card.pop(record.identity.card_id, None)
            self.scheduler.remove_card(record.identity.card_id)
        record.identity = identity
        self._close_link(record)
        record.link = CardLink(identity.link_endpoint, identity.link_token)
        record.state = UP
        record.failure = None
        record.progress, record.progress_at = -1, time.monotonic()
        self._by_card[identity.card_id] = record
        self.scheduler.add_card(identity.card_id)
        for session in sessions:
            self.scheduler.adopt_session(session.session_id, identity.card_id, session.last_used)
        if sessions and self._on_sessions_adopted is not None:
            self._on_sessions_adopted(sessions)
        if self._on_card_up is not None:
            self._on_card_up(identity.card_id)
        log.info("card %s: serving (metrics at %s)", identity.card_id, identity.metrics_endpoint)
        self._card_ready.set()
        self._changed()

    async def _take_over(self, record: CardRecord, settings: CardSettings) -> list[SessionRecord]:
        """Adopt a running card: it must run this router's settings; generations its previous router
        started are stopped (nobody reads them); returns the sessions it caches, to bind them."""
        timeout_s = self.config.call_timeout_s
        theirs = await asyncio.wait_for(record.actor.card_settings.remote(), timeout_s)
        if theirs != settings:
            raise ValueError(f"it runs other settings ({theirs})")
        stopped = await asyncio.wait_for(record.actor.stop_generations.remote(), timeout_s)
        sessions: list[SessionRecord] = await asyncio.wait_for(record.actor.sessions.remote(), timeout_s)
        log.info("adopted card: %d orphaned generations stopped, %d cached sessions", stopped, len(sessions))
        return sessions

    def _give_up(self, record: CardRecord, why: str) -> None:
        log.error("card %s %s; its slot is refilled in %.0fs", record.card_id, why, RECREATE_BACKOFF_S)
        self._dead_slots[record.key] = time.monotonic() + RECREATE_BACKOFF_S
        self._drop(record, kill=True)

    def _drop(self, record: CardRecord, *, kill: bool) -> None:
        self._records.pop(record.key, None)
        if record.identity is not None:
            self._by_card.pop(record.identity.card_id, None)
            self.scheduler.remove_card(record.identity.card_id)
        if record.task is not None and record.task is not asyncio.current_task():
            record.task.cancel()
        self._close_link(record)
        if kill:
            with contextlib.suppress(Exception):
                ray.kill(record.actor, no_restart=True)
        self._changed()

    def _close_link(self, record: CardRecord) -> None:
        """Close the record's link (ending any call still on it) in the background."""
        if record.link is None:
            return
        closing = asyncio.ensure_future(record.link.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        record.link = None

    # ---- failures -------------------------------------------------------------------------------
    def report_failure(
        self, card_id: str, what: str, *, hung: bool, seen: CardIdentity | None = None
    ) -> None:
        """A card died or hung: take it out of service and wait for its actor to come back. `seen`: the
        incarnation the failed call went to; a late failure of a call to an earlier one is ignored."""
        record = self._by_card.get(card_id)
        if record is None or record.state != UP or (seen is not None and seen is not record.identity):
            return
        log.warning("card %s %s; restarting it", card_id, what)
        record.state = RECOVERING
        record.failure = what
        record.restarts += 1
        self.scheduler.card_down(card_id)
        replacing = None
        if hung and record.identity is not None:
            # A signal ends a wedged or frozen process alike, and Ray restarts the actor (max_restarts).
            # Not ray.kill as well: a frozen process never hears it, and when both land on a live one
            # the two deaths can race in Ray's restart and leave the actor restarting for good.
            replacing = record.identity
            _kill_on_node(record.identity.node_id, record.identity.pid)
        self._start_bring_up(record, replacing=replacing)
        self._changed()

    async def check_health(self) -> None:
        """Ping every serving card: a silent, stalled or restarted one is down."""
        serving = [(r, r.identity) for r in self._records.values() if r.state == UP]
        results = await asyncio.gather(*(self._ping(r) for r, _ in serving))
        for (record, identity), (ok, what, hung) in zip(serving, results, strict=True):
            if not ok:
                self.report_failure(record.card_id, what, hung=hung, seen=identity)

    async def _ping(self, record: CardRecord) -> tuple[bool, str, bool]:
        """(alive, what is wrong, hung)."""
        timeout_s = self.config.stall_timeout_s
        try:
            liveness: CardLiveness = await asyncio.wait_for(record.actor.ping.remote(), timeout_s)
        except asyncio.TimeoutError:
            return False, f"did not answer a ping within {timeout_s:.0f}s (hung)", True
        except RayError as e:
            return False, f"is unreachable: {_first_line(e)}", False
        if record.identity is not None and liveness.incarnation != record.identity.incarnation:
            return False, "restarted (its cache is gone)", False
        now = time.monotonic()
        if not liveness.busy or liveness.progress != record.progress:
            record.progress, record.progress_at = liveness.progress, now
        elif now - record.progress_at > timeout_s:
            return (
                False,
                f"made no progress for {now - record.progress_at:.0f}s while generating (hung)",
                True,
            )
        return True, "", False

    def failure(self, card_id: str) -> str | None:
        """Why a card a stream runs on stopped serving; None while it serves."""
        record = self._by_card.get(card_id)
        if record is None:
            return "left the pool"
        return record.failure if record.state != UP else None

    # ---- lookups --------------------------------------------------------------------------------
    def actor(self, card_id: str) -> Any:
        record = self._by_card.get(card_id)
        if record is None:
            raise KeyError(card_id)
        return record.actor

    def link(self, card_id: str) -> CardLink:
        record = self._by_card.get(card_id)
        if record is None or record.link is None:
            raise KeyError(card_id)
        return record.link

    def identity(self, card_id: str) -> CardIdentity | None:
        record = self._by_card.get(card_id)
        return record.identity if record else None

    def records(self) -> list[CardRecord]:
        return sorted(self._records.values(), key=lambda r: (r.node_id, r.slot))

    def live_cards(self) -> list[str]:
        return [r.card_id for r in self._records.values() if r.state == UP]

    def state_counts(self) -> dict[str, int]:
        """Cards by the router metric's states: starting and recovering cards count as down."""
        counts = {"free": 0, "busy": 0, "down": 0}
        phases = self.scheduler.card_phases()
        for record in self._records.values():
            phase = phases.get(record.card_id) if record.state == UP else None
            counts[phase.value if phase is not None else "down"] += 1
        return counts

    def sd_targets(self) -> list[dict[str, Any]]:
        """Prometheus HTTP SD target groups of the live cards (read from the metrics thread)."""
        return self._sd_snapshot

    def _changed(self) -> None:
        groups = []
        for record in self.records():
            ident = record.identity
            if ident is None or record.state != UP:
                continue
            groups.append(
                {
                    "targets": [ident.metrics_endpoint],
                    "labels": {
                        "role": "card",
                        "__meta_onestream_card": ident.card_id,
                        "__meta_onestream_node": ident.node_short,
                        "__meta_onestream_node_ip": ident.node_ip,
                        "__meta_onestream_gpu_index": str(ident.gpu_index),
                        "__meta_onestream_gpu_uuid": ident.gpu_uuid,
                    },
                }
            )
        self._sd_snapshot = groups
        self._on_change()


def card_actor_name(node_id: str, slot: int) -> str:
    """The Ray name of the card actor of a slot (in the pool's namespace)."""
    return f"onestream-card-{node_id}-{slot}"


def _named_actor(name: str, namespace: str) -> Any | None:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _kill_process(pid: int) -> bool:
    import os
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _kill_on_node(node_id: str, pid: int) -> None:
    """SIGKILL a card's process from a small task on its node (fire and forget): Ray then sees the
    actor die and restarts it."""
    ray.remote(num_cpus=0, max_retries=0)(_kill_process).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    ).remote(pid)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

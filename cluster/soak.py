"""A soak run: a real local multi-node Ray cluster (`ray.cluster_utils.Cluster`) serving CPU cards, many
multi-turn sessions with random client cancels and Aborts, and faults while they run: one card actor
killed, one node removed and another added, the router restarted. At the end it checks what must hold
whatever happened (`SoakReport.problems`). CI runs it small (tests/test_pool_soak.py); `onestream soak`
runs it with larger numbers.
"""

from __future__ import annotations

import contextlib
import logging
import random
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from onestream.protos.onestream.v1 import onestream_pb2 as pb

from . import wire
from .client import PoolClient, make_request
from .server import PoolThread
from .testing import add_card_node, cpu_pool_config, start_cluster, stop_cluster, wait_for

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # cards (re)starting on a busy machine
SETTLE_TIMEOUT_S = 120.0  # for the pool to be idle and the cards to agree at the end


@dataclass
class SoakSettings:
    cards: int = 2  # one per node at the start
    sessions: int = 4
    turns: int = 5  # per session
    max_tokens: int = 48
    cancel_rate: float = 0.15  # of turns: the client cancels the call after its first chunk
    abort_rate: float = 0.15  # of turns: Abort(request_id) after its first chunk
    memory_bound_mb: float = 200.0  # a surviving card's resident memory may grow this much at most
    seed: int | None = None
    model_dir: str | None = None  # default: a tiny random checkpoint


@dataclass
class TurnResult:
    session_id: str
    request_id: str
    code: str  # "OK" or the status code's name
    chunk_tokens: int = 0
    generated_tokens: int | None = None  # from `finished`
    card_id: str = ""


@dataclass
class SoakReport:
    turns: list[TurnResult] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    memory_mb: dict[str, tuple[float, float]] = field(default_factory=dict)  # card -> (start, end)
    seconds: float = 0.0

    def summary(self) -> str:
        codes = Counter(t.code for t in self.turns)
        memory = ", ".join(f"{c}: {a:.0f}->{b:.0f} MB" for c, (a, b) in sorted(self.memory_mb.items()))
        return (
            f"{len(self.turns)} turns in {self.seconds:.0f}s ({dict(sorted(codes.items()))}); "
            f"faults: {'; '.join(self.faults)}; card memory: {memory or 'n/a'}; "
            f"problems: {len(self.problems)}"
        )


class _Pool:
    """The cluster and the router over it; the router can be restarted on the same port."""

    def __init__(self, settings: SoakSettings, workdir: Path) -> None:
        from onestream.worker.testing import write_tiny_checkpoint

        self.cluster = start_cluster([1] * settings.cards)  # a card per node
        self.nodes = list(self.cluster.worker_nodes)
        model_dir = settings.model_dir or str(write_tiny_checkpoint(workdir / "tiny"))
        self.config = cpu_pool_config(
            model_dir,
            engine_options={"max_context": 1024},
            queue_capacity=4 * settings.sessions,
            home_wait_s=0.5,
            first_token_timeout_s=60.0,
            token_timeout_s=30.0,
            drain_timeout_s=30.0,
        )
        self.router = PoolThread(self.config).start(
            wait_for_cards=settings.cards, ready_timeout_s=START_TIMEOUT_S
        )
        self.address = self.router.grpc_address
        self.config.grpc_address = self.address  # a restarted router listens where clients connect

    def restart_router(self) -> None:
        self.router.stop()
        self.router = PoolThread(self.config).start(wait_for_cards=1, ready_timeout_s=START_TIMEOUT_S)

    def actor(self, card_id: str) -> Any:
        return self.router.call(self.router.pool.registry.actor, card_id)

    def card_ids(self) -> list[str]:
        return sorted(self.router.call(self.router.pool.registry.live_cards))

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.router.stop()
        stop_cluster(self.cluster)


def run_soak(settings: SoakSettings) -> SoakReport:
    """Run the soak and check it; `report.problems` lists every check that failed."""
    rng = random.Random(
        settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**31)
    )
    report = SoakReport()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="onestream-soak-") as workdir:
        pool = _Pool(settings, Path(workdir))
        try:
            with PoolClient(pool.address, timeout_s=60.0) as client:
                start_memory = _card_memory(pool, client)
                _run_sessions(pool, client, settings, rng, report)
                _check_end(pool, client, settings, start_memory, report)
        finally:
            pool.shutdown()
    report.seconds = time.monotonic() - started
    return report


# ---- load -----------------------------------------------------------------------------------------
def _run_sessions(
    pool: _Pool, client: PoolClient, settings: SoakSettings, rng: random.Random, report: SoakReport
) -> None:
    done_turns = Counter[str]()
    lock = threading.Lock()
    seeds = [rng.randrange(2**31) for _ in range(settings.sessions)]

    def session(index: int) -> None:
        local = random.Random(seeds[index])
        session_id = f"soak-{index}-{uuid.uuid4().hex[:6]}"
        prompt = f"# session {index}\ndef f{index}(x):\n"
        for _ in range(settings.turns):
            result, text = _turn(client, session_id, prompt, settings, local)
            with lock:
                report.turns.append(result)
                done_turns[session_id] += 1
            prompt += text + f"\n# turn\ndef g{local.randrange(100)}(y):\n"

    threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(settings.sessions)]
    for thread in threads:
        thread.start()
    total = settings.sessions * settings.turns

    def progressed(fraction: float) -> Callable[[], bool]:
        return lambda: len(report.turns) >= fraction * total

    faults: list[tuple[float, str, Callable[[], None]]] = [
        (0.2, "killed a card actor", lambda: _kill_card(pool, rng)),
        (0.4, "added a node, removed another", lambda: _replace_node(pool, settings)),
        (0.6, "restarted the router", lambda: _restart_router(pool, client, report)),
    ]
    for fraction, what, fault in faults:
        wait_for(progressed(fraction), START_TIMEOUT_S, f"{fraction:.0%} of the turns")
        fault()
        report.faults.append(what)
    for thread in threads:
        thread.join(START_TIMEOUT_S)
        if thread.is_alive():
            report.problems.append("a session thread did not finish its turns")


def _turn(
    client: PoolClient, session_id: str, prompt: str, settings: SoakSettings, rng: random.Random
) -> tuple[TurnResult, str]:
    """One turn; whatever happens, it ends with a final message or a status."""
    request_id = uuid.uuid4().hex
    request = make_request(
        prompt,
        session_id=session_id,
        request_id=request_id,
        max_tokens=rng.randint(4, settings.max_tokens),
        ignore_eos=True,
    )
    result = TurnResult(session_id, request_id, "OK")
    roll = rng.random()
    action = (
        "cancel"
        if roll < settings.cancel_rate
        else "abort"
        if roll < settings.cancel_rate + settings.abort_rate
        else None
    )
    text = ""
    finished: pb.Finished | None = None
    call = client.generate(request, timeout_s=START_TIMEOUT_S)
    try:
        for event in call:
            kind = event.WhichOneof("event")
            if kind == "chunk":
                result.chunk_tokens += len(event.chunk.token_ids)
                text += event.chunk.text
                if action == "cancel":
                    call.cancel()
                elif action == "abort":
                    client.abort(request_id)
                action = None
            elif kind == "assigned":
                result.card_id = event.assigned.card.card_id
            elif kind == "finished":
                finished = event.finished
    except grpc.RpcError as e:
        result.code = e.code().name
    if finished is not None:
        result.generated_tokens = finished.usage.generated_tokens
    elif result.code == "OK":
        result.code = "NO_FINAL_MESSAGE"
    return result, text


# ---- faults ---------------------------------------------------------------------------------------
def _kill_card(pool: _Pool, rng: random.Random) -> None:
    """Kill a card off the head node where there is one: the head's card, which no fault touches, is the
    soak's witness for the memory bound."""
    import ray

    head = pool.cluster.head_node.node_id
    cards = pool.card_ids()
    # A card id opens with its node's id, shortened.
    off_head = [c for c in cards if not head.startswith(c.split("/", 1)[0])]
    ray.kill(pool.actor(rng.choice(off_head or cards)), no_restart=False)


def _replace_node(pool: _Pool, settings: SoakSettings) -> None:
    """Add a node (its card joins), then remove a node that is not the head (its card leaves)."""
    before = set(pool.card_ids())
    added = add_card_node(pool.cluster)
    wait_for(lambda: set(pool.card_ids()) - before, START_TIMEOUT_S, "the added node's card")
    if pool.nodes:
        pool.cluster.remove_node(pool.nodes.pop(0))
    pool.nodes.append(added)


def _restart_router(pool: _Pool, client: PoolClient, report: SoakReport) -> None:
    """Stop the router and start another on the same port: it adopts the running cards, which keep
    their processes (and caches). The sessions' client, which called while it was down, reaches it again
    within its channel's reconnection backoff (cluster/wire.py)."""
    before = _incarnations(pool)
    pool.restart_router()
    wait_for(lambda: set(pool.card_ids()) >= set(before), START_TIMEOUT_S, "the cards to be adopted")
    wait_for(
        lambda: _reachable(client),
        2 * wire.MAX_RECONNECT_BACKOFF_MS / 1e3 + 5.0,
        "the client to reach the restarted router",
    )
    after = _incarnations(pool)
    for card, incarnation in before.items():
        if after.get(card, incarnation) != incarnation:
            report.problems.append(f"card {card} restarted with the router: its cache was lost")


def _reachable(client: PoolClient) -> bool:
    try:
        client.pool_status()
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False
    return True


def _incarnations(pool: _Pool) -> dict[str, str]:
    """card -> incarnation of the cards serving now (one that leaves meanwhile is left out)."""
    import ray

    found = {}
    for card_id in pool.card_ids():
        with contextlib.suppress(KeyError, ray.exceptions.RayError):
            found[card_id] = ray.get(pool.actor(card_id).ping.remote(), timeout=60).incarnation
    return found


# ---- checks ---------------------------------------------------------------------------------------
def _check_end(
    pool: _Pool,
    client: PoolClient,
    settings: SoakSettings,
    start_memory: dict[str, tuple[str, float]],
    report: SoakReport,
) -> None:
    problems = report.problems
    expected = settings.sessions * settings.turns
    if len(report.turns) != expected:
        problems.append(f"{len(report.turns)} of {expected} turns ended with a final message or a status")
    for turn in report.turns:
        if turn.code == "NO_FINAL_MESSAGE":
            problems.append(f"turn {turn.request_id} ended without a final message or a status")
        if turn.generated_tokens is not None and turn.generated_tokens != turn.chunk_tokens:
            problems.append(
                f"turn {turn.request_id}: chunks carried {turn.chunk_tokens} tokens, usage says {turn.generated_tokens}"
            )
        if turn.code in ("UNKNOWN", "INTERNAL"):
            problems.append(f"turn {turn.request_id} ended {turn.code}")
    try:
        wait_for(lambda: _idle(client, len(pool.card_ids())), SETTLE_TIMEOUT_S, "the pool to be idle")
    except TimeoutError as e:
        problems.append(f"{e}: {client.pool_status()}")
    try:
        wait_for(
            lambda: _listed_equals_cached(pool, client),
            SETTLE_TIMEOUT_S,
            "listed sessions to equal cached ones",
        )
    except TimeoutError:
        listed, cached = _sessions(pool, client)
        problems.append(f"listed sessions {sorted(listed)} != cached sessions {sorted(cached)}")
    for session in client.sessions():
        with contextlib.suppress(grpc.RpcError):
            client.close_session(session.session_id)
    end_memory = _card_memory(pool, client)
    for card_id, (incarnation, start_mb) in start_memory.items():
        if card_id in end_memory and end_memory[card_id][0] == incarnation:  # the same process throughout
            end_mb = end_memory[card_id][1]
            report.memory_mb[card_id] = (start_mb, end_mb)
            if end_mb - start_mb > settings.memory_bound_mb:
                problems.append(f"card {card_id} grew from {start_mb:.0f} to {end_mb:.0f} MB")


def _idle(client: PoolClient, cards: int) -> bool:
    status = client.pool_status()
    return status.in_flight == 0 and status.cards_busy == 0 and status.cards_free == cards > 0


def _sessions(pool: _Pool, client: PoolClient) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """(session, card) pairs as the router lists them, and as the cards cache them."""
    import ray

    listed = {(s.session_id, s.card_id) for s in client.sessions()}
    cached = set()
    for card_id in pool.card_ids():
        for record in ray.get(pool.actor(card_id).sessions.remote(), timeout=60):
            cached.add((record.session_id, card_id))
    return listed, cached


def _listed_equals_cached(pool: _Pool, client: PoolClient) -> bool:
    listed, cached = _sessions(pool, client)
    return listed == cached


def _card_memory(pool: _Pool, client: PoolClient) -> dict[str, tuple[str, float]]:
    """card -> (incarnation, resident MB)."""
    import ray

    memory = {}
    for card_id in pool.card_ids():
        with contextlib.suppress(KeyError, ray.exceptions.RayError):
            actor = pool.actor(card_id)
            status = ray.get(actor.status.remote(), timeout=60)
            incarnation = ray.get(actor.ping.remote(), timeout=60).incarnation
            memory[card_id] = (incarnation, status.get("rss_bytes", 0) / 1e6)
    return memory

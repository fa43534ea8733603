"""`onestream serve --address` on a pool that is already running, as an operator upgrades the router: a
real 2-node Ray cluster (`ray.cluster_utils.Cluster`) with a CPU card on each node, a serve process killed
while it streams and another started in its place, on the same port. The new router adopts the running
card actors (the same processes, with their caches) and learns from the cards who owns each session, so
that sessions go on where they were and stay their owners'; the stream the killed router carried is the
only one that failed, and its card was freed; a card that dies afterwards is restarted and rejoins."""

from __future__ import annotations

import contextlib
import secrets
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import ray
from onestream.cluster.cards import card_actor_name
from onestream.cluster.client import PoolClient, make_request
from onestream.cluster.testing import wait_for
from onestream.worker.testing import write_tiny_checkpoint
from pool_helpers import Serve, run_turn, start_turn
from ray.cluster_utils import Cluster

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 240.0  # a serve process importing torch and adopting or starting cards on 2 busy cores
CARDS = 2
MAX_CONTEXT = 2048  # a stream of MAX_CONTEXT - 48 tokens outlasts the router's kill
NAMESPACE = "onestream"  # where `onestream serve` names its cards
GRAB_INTERVAL_S = 0.05
KEYS = {user: secrets.token_urlsafe(24) for user in ("alice", "bob")}


@pytest.fixture(scope="module")
def pool_cards() -> tuple[int, ...]:
    return (1,) * CARDS  # a card on each node (tests/conftest.py starts the cluster)


@pytest.fixture(scope="module")
def serve_args(tmp_path_factory: pytest.TempPathFactory, cluster: Cluster) -> list[str]:
    workdir = tmp_path_factory.mktemp("serve")
    keys = workdir / "api-keys"
    keys.write_text("".join(f"{key} {user}\n" for user, key in KEYS.items()))
    model_dir = write_tiny_checkpoint(workdir / "tiny")
    return [
        "--address", cluster.address, "--model", str(model_dir), "--cpu-cards", "0",
        "--max-context", str(MAX_CONTEXT), "--api-keys", str(keys),
    ]  # fmt: skip


@pytest.fixture
def serves() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for serve in started:
        serve.kill()


def card_actors() -> list[Any]:
    """The card actor of every node's one slot, found by name as an operator would."""
    return [
        ray.get_actor(card_actor_name(node["NodeID"], 0), namespace=NAMESPACE)
        for node in ray.nodes()
        if node.get("Alive")
    ]


def card_actor(card_id: str) -> Any:
    (actor,) = [a for a in card_actors() if ray.get(a.ready.remote(), timeout=60).card_id == card_id]
    return actor


def card_processes() -> dict[str, tuple[str, int]]:
    """card id -> (incarnation, pid) of each card actor's process, read from Ray (a restarting one is
    left out)."""
    found = {}
    for actor in card_actors():
        with contextlib.suppress(ray.exceptions.RayError):
            identity = ray.get(actor.ready.remote(), timeout=60)
            found[identity.card_id] = (identity.incarnation, identity.pid)
    return found


def idle(client: PoolClient) -> bool:
    status = client.pool_status()
    return status.cards_free == CARDS and status.cards_busy == 0 and status.in_flight == 0


class Grabber:
    """bob naming alice's session again and again, each time on a new connection (a channel that
    failed backs off before it reconnects): the status code of every try, ADOPTING for the router's
    UNAVAILABLE while it adopts the cards."""

    def __init__(self, address: str, session: str) -> None:
        self.codes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, session), daemon=True)
        self._thread.start()

    def _run(self, address: str, session: str) -> None:
        while not self._stop.is_set():
            with PoolClient(address, timeout_s=5, api_key=KEYS["bob"]) as bob:
                turn = run_turn(bob, make_request("y", session_id=session, max_tokens=2), timeout_s=5)
            error = turn.error
            adopting = error is not None and "adopting" in (error.details() or "")
            self.codes.append("ADOPTING" if adopting else error.code().name if error is not None else "OK")
            self._stop.wait(GRAB_INTERVAL_S)

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(30)
        return self.codes


def rejected(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


def test_a_restarted_serve_adopts_the_running_cards_their_sessions_and_owners(
    serve_args: list[str], serves: list[Serve]
) -> None:
    first = Serve(*serve_args, http="off")
    serves.append(first)
    address = first.wait_for_line(r"gRPC\s+(\S+:\d+)", START_TIMEOUT_S).group(1)
    first.wait_for_line(r"ready", 60)
    alice = PoolClient(address, timeout_s=60, api_key=KEYS["alice"])
    bob = PoolClient(address, timeout_s=60, api_key=KEYS["bob"])
    with alice, bob:
        wait_for(lambda: idle(alice), START_TIMEOUT_S, "both cards to serve")
        session = f"alice-{secrets.token_hex(4)}"
        prompt = [65 + i % 40 for i in range(60)]
        before = run_turn(alice, make_request(prompt, session_id=session, max_tokens=8, temperature=0.0))
        assert before.error is None and before.finished is not None
        home = before.card_id
        carried = start_turn(
            alice, make_request("x", session_id="alice-long", max_tokens=MAX_CONTEXT - 48, ignore_eos=True)
        )
        assert carried.first_chunk.wait(60) and carried.error is None
        processes = card_processes()
        assert set(processes) == {c.card_id for c in alice.cards()}

        first.kill()  # SIGKILL: the router goes away with a stream in flight
        assert carried.done.wait(60)
        assert carried.error is not None and carried.error.code() == grpc.StatusCode.UNAVAILABLE
        second = Serve(*serve_args, listen=address, http="off")
        serves.append(second)
        starting = Grabber(address, session)  # bob tries to take the session while the router starts
        second.wait_for_line(r"ready", START_TIMEOUT_S)
        codes = starting.stop()
        print(f"bob's tries while the router started: {Counter(codes)}")
        assert set(codes) <= {"UNAVAILABLE", "ADOPTING", "PERMISSION_DENIED"}, Counter(codes)

        assert card_processes() == processes, "the same card processes serve: none was restarted"
        wait_for(lambda: idle(alice), 60, "the adopted cards to be free (the orphaned stream stopped)")
        # Before alice's next turn: the new router learnt the session's owner from its card, so bob can
        # neither take it (and its cache) nor close it.
        taken = run_turn(bob, make_request("y", session_id=session, max_tokens=2))
        assert taken.error is not None and taken.error.code() == grpc.StatusCode.PERMISSION_DENIED
        closed = rejected(lambda: bob.close_session(session))
        assert closed.code() == grpc.StatusCode.PERMISSION_DENIED
        assert session not in {s.session_id for s in bob.sessions()}
        listed = {s.session_id: s for s in alice.sessions()}
        assert listed[session].user == "alice" and listed[session].card_id == home
        follow_up = prompt + before.token_ids + [66, 67, 68]
        after = run_turn(alice, make_request(follow_up, session_id=session, max_tokens=8, temperature=0.0))
        assert after.error is None and after.finished is not None
        assert after.card_id == home and after.assigned[-1].affinity_hit, "the session kept its home"
        assert after.finished.usage.cached_prompt_tokens >= len(prompt), "and its home kept its cache"

        assert alice.close_session(session) == home

        # A card that dies now, its creator gone, is still restarted by Ray (Ray warns that creation
        # arguments in the object store may be lost with their owner) and rejoins the new router.
        ray.kill(card_actor(home), no_restart=False)
        wait_for(
            lambda: card_processes().get(home, processes[home]) != processes[home], 60, f"{home} restarted"
        )
        wait_for(lambda: idle(alice), START_TIMEOUT_S, f"card {home} to serve again")
        assert {c.card_id: c.restarts for c in alice.cards()}[home] == 1

        second.process.send_signal(signal.SIGTERM)
        assert second.process.wait(120) == 0, "".join(second.output)[-4000:]

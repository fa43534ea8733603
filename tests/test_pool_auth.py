"""Users on a real pool: API keys, session ownership, per-user limits and counters, key reloads, over
the real gRPC router and the HTTP front door (the official openai SDK) of a real Ray cluster with 2 CPU
cards running the embedded model (one cluster for the module)."""

from __future__ import annotations

import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import grpc
import openai
import pytest
from onestream.cluster.auth import RETRY_AFTER
from onestream.cluster.client import PoolClient, make_request
from onestream.cluster.server import PoolThread
from onestream.cluster.testing import wait_for
from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.protos.onestream.v1 import onestream_pb2_grpc as pb_grpc
from onestream.worker.loading import default_model_dir
from pool_helpers import scrape

pytestmark = pytest.mark.slow

CARDS = 2
MAX_CONTEXT = 1024
WAIT_S = 180.0
USER_MAX_CONCURRENT = 2
USER_MAX_QUEUED = 1
RETRY_AFTER_S = 3
KEYS = {name: secrets.token_urlsafe(24) for name in ("alice", "bob", "ops", "carol")}


def key_file(path: Path, *users: str) -> None:
    lines = [f"{KEYS[user]} {user}{' admin' if user == 'ops' else ''}" for user in users]
    path.write_text("# test keys\n" + "\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def keys_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file(path, "alice", "bob", "ops")
    return path


# tests/conftest.py builds the cluster and the router from these.
@pytest.fixture(scope="module")
def pool_cards() -> tuple[int, ...]:
    return (CARDS,)


@pytest.fixture(scope="module")
def pool_model_dir() -> str:
    return str(default_model_dir())  # real text: the HTTP SDKs parse what comes back


@pytest.fixture(scope="module")
def pool_settings(keys_path: Path) -> dict[str, Any]:
    return {
        "http_address": "127.0.0.1:0",
        "engine_options": {"max_context": MAX_CONTEXT},
        "queue_capacity": 8,
        "home_wait_s": 0.5,
        "first_token_timeout_s": 30.0,
        "api_keys_path": str(keys_path),
        "user_max_concurrent": USER_MAX_CONCURRENT,
        "user_max_queued": USER_MAX_QUEUED,
        "retry_after_s": RETRY_AFTER_S,
        "metrics_per_user": True,
    }


@pytest.fixture(scope="module")
def clients(pool: PoolThread) -> Iterator[dict[str, PoolClient]]:
    made = {user: PoolClient(pool.grpc_address, timeout_s=60.0, api_key=key) for user, key in KEYS.items()}
    yield made
    for client in made.values():
        client.close()


def http_client(pool: PoolThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{pool.http_address}/v1", api_key=key, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, session: str | None = None) -> Any:
    headers = {"x-session-id": session} if session else None
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=3,
        temperature=0.0,
        extra_headers=headers,
    )


def claude_client(pool: PoolThread, key: str) -> anthropic.Anthropic:
    """Anthropic's SDK: it sends the key as `x-api-key`."""
    return anthropic.Anthropic(
        base_url=f"http://{pool.http_address}", api_key=key, max_retries=0, timeout=120
    )


def message(client: anthropic.Anthropic, session: str | None = None) -> Any:
    return client.messages.create(
        model="default_model",
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=3,
        extra_headers={"x-session-id": session} if session else None,
    )


# ---- helpers --------------------------------------------------------------------------------------
class Stream:
    """A Generate call read on a background thread."""

    def __init__(self, client: PoolClient, request: pb.GenerateRequest) -> None:
        self.call = client.generate(request, timeout_s=WAIT_S)
        self.events: list[pb.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self.started = threading.Event()  # a card is assigned
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for event in self.call:
                self.events.append(event)
                if event.WhichOneof("event") == "chunk":
                    self.started.set()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.started.set()
            self.done.set()

    def tokens(self) -> int:
        return sum(len(e.chunk.token_ids) for e in self.events if e.WhichOneof("event") == "chunk")


def long_turn(session: str, request_id: str = "") -> pb.GenerateRequest:
    return make_request(
        "def main():",
        session_id=session,
        request_id=request_id,
        max_tokens=MAX_CONTEXT - 48,
        ignore_eos=True,
        temperature=0.0,
    )


def short_turn(session: str = "") -> pb.GenerateRequest:
    return make_request("x = 1", session_id=session, max_tokens=3, temperature=0.0)


def rejected(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (list, str)):
            list(result)
    return error.value


def stop(client: PoolClient, *streams: Stream) -> None:
    for stream in streams:
        stream.call.cancel()
    for stream in streams:
        assert stream.done.wait(30)


def wait_until_idle(pool: PoolThread) -> None:
    wait_for(
        lambda: pool.call(lambda: pool.pool.router.in_flight) == 0, 30, "no request in flight", poll_s=0.05
    )


def user_counters(pool: PoolThread) -> dict[tuple[str, str, str | None], float]:
    return {
        (name, dict(labels).get("user", ""), dict(labels).get("reason")): value
        for (name, labels), value in scrape(pool.metrics_address).items()
        if name.startswith("onestream_router_user_")
    }


# ---- tests ----------------------------------------------------------------------------------------
def test_every_rpc_wants_a_valid_key_and_never_echoes_it(pool: PoolThread) -> None:
    wrong = secrets.token_urlsafe(24)
    methods = pb.DESCRIPTOR.services_by_name["OneStream"].methods
    requests = {"Generate": short_turn("s"), "CloseSession": pb.CloseSessionRequest(session_id="s")}
    with grpc.insecure_channel(pool.grpc_address) as channel:
        for method in methods:
            request_class = getattr(pb, method.input_type.name)
            request = requests.get(method.name, request_class())
            path = f"/{method.containing_service.full_name}/{method.name}"
            rpc = (channel.unary_stream if method.server_streaming else channel.unary_unary)(
                path, request_serializer=request_class.SerializeToString, response_deserializer=lambda b: b
            )
            for metadata, message in (
                ((), "needs an API key: send the metadata `authorization: Bearer KEY`"),
                ((("authorization", f"Bearer {wrong}"),), "the API key is not valid"),
                ((("authorization", wrong),), "must be `Bearer KEY`"),
            ):
                error = rejected(
                    lambda rpc=rpc, request=request, metadata=metadata: rpc(
                        request, metadata=metadata, timeout=30
                    )
                )
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (method.name, error)
                assert message in error.details() and wrong not in error.details(), method.name
    # Health stays open to load balancers, which hold no key.
    with PoolClient(pool.grpc_address) as anonymous:
        assert anonymous.health() == "SERVING"
    assert pool.call(pool.pool.router.owners.owner_of, "s") is None, "a refused turn claims no session"


def test_a_session_belongs_to_the_user_who_opened_it(
    pool: PoolThread, clients: dict[str, PoolClient]
) -> None:
    alice, bob, ops = clients["alice"], clients["bob"], clients["ops"]
    events = list(alice.generate(short_turn("alice-notes")))
    assert events[-1].finished.usage.generated_tokens > 0
    list(bob.generate(short_turn("bob-notes")))

    error = rejected(lambda: bob.generate(short_turn("alice-notes")))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "session 'alice-notes' belongs to another user" in error.details()
    error = rejected(lambda: bob.close_session("alice-notes"))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "belongs to another user" in error.details()

    running = Stream(alice, long_turn("alice-long", request_id="alice-long-1"))
    assert running.started.wait(60) and running.error is None
    error = rejected(lambda: bob.abort("bob-unknown", "alice-long-1"))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "request 'alice-long-1' belongs to another user; nothing was aborted" in error.details()
    time.sleep(0.3)
    assert not running.done.is_set(), "bob's Abort stopped alice's stream"
    assert alice.abort("alice-long-1") == ["alice-long-1"]
    assert running.done.wait(30) and running.error.code() == grpc.StatusCode.CANCELLED

    def listed(client: PoolClient) -> dict[str, str]:
        return {s.session_id: s.user for s in client.sessions()}

    assert listed(alice) == {"alice-notes": "alice", "alice-long": "alice"}
    assert listed(bob) == {"bob-notes": "bob"}
    everyone = listed(ops)
    assert everyone == {"alice-notes": "alice", "alice-long": "alice", "bob-notes": "bob"}
    # The owner, and an admin, may close a session; afterwards its id is free to take.
    assert alice.close_session("alice-notes")
    assert ops.close_session("bob-notes")
    assert "bob-notes" not in listed(bob)
    list(bob.generate(short_turn("alice-notes")))
    assert listed(bob) == {"alice-notes": "bob"}
    wait_until_idle(pool)


def test_a_user_over_its_limits_gets_resource_exhausted_with_a_retry_hint(
    pool: PoolThread, clients: dict[str, PoolClient]
) -> None:
    alice, bob = clients["alice"], clients["bob"]
    before = user_counters(pool)
    # bob fills both cards: his limit of requests in flight.
    bobs = [Stream(bob, long_turn(f"bob-{i}")) for i in range(USER_MAX_CONCURRENT)]
    for stream in bobs:
        assert stream.started.wait(60) and stream.error is None
    error = rejected(lambda: bob.generate(short_turn()))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"(--user-max-concurrent {USER_MAX_CONCURRENT})" in error.details()
    assert dict(error.trailing_metadata())[RETRY_AFTER] == str(RETRY_AFTER_S)
    # alice may queue one request; her second is refused, but not her requests' neighbours.
    queued = Stream(alice, short_turn("alice-q1"))
    wait_for(lambda: any(e.WhichOneof("event") == "queued" for e in queued.events), 30, "alice queued")
    error = rejected(lambda: alice.generate(short_turn("alice-q2")))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"(--user-max-queued {USER_MAX_QUEUED})" in error.details()
    assert dict(error.trailing_metadata())[RETRY_AFTER] == str(RETRY_AFTER_S)
    assert not queued.done.is_set()
    stop(bob, *bobs)
    assert queued.done.wait(60) and queued.error is None, queued.error
    assert queued.events[-1].finished.usage.generated_tokens > 0
    wait_until_idle(pool)

    after = user_counters(pool)

    def grew(name: str, user: str, reason: str | None = None) -> float:
        key = (f"onestream_router_user_{name}_total", user, reason)
        return after[key] - before.get(key, 0.0)

    assert grew("rejections", "bob", "user_concurrent") == 1
    assert grew("rejections", "alice", "user_queued") == 1
    assert grew("rejections", "alice", "user_concurrent") == 0
    assert grew("requests", "bob") == USER_MAX_CONCURRENT + 1 and grew("requests", "alice") == 2
    finished = queued.events[-1].finished.usage
    assert grew("prompt_tokens", "alice") == finished.prompt_tokens
    assert grew("generation_tokens", "alice") == finished.generated_tokens
    # The router counts what it sent; a cancelled stream's reader may not have read the last of it.
    assert grew("generation_tokens", "bob") >= sum(s.tokens() for s in bobs) > 0
    assert ("onestream_router_user_requests_total", "carol", None) not in after, "carol has no key yet"


def test_sighup_reload_adds_and_removes_keys_without_dropping_streams(
    pool: PoolThread, clients: dict[str, PoolClient], keys_path: Path
) -> None:
    alice, bob, carol = clients["alice"], clients["bob"], clients["carol"]
    assert rejected(lambda: carol.pool_status()).code() == grpc.StatusCode.UNAUTHENTICATED
    running = Stream(bob, long_turn("bob-reload"))
    assert running.started.wait(60)
    try:
        key_file(keys_path, "alice", "ops", "carol")  # bob's key removed, carol's added
        assert pool.call(pool.pool.reload_keys)
        assert carol.pool_status().cards_busy >= 1
        assert list(carol.generate(short_turn("carol-1")))[-1].finished.usage.generated_tokens > 0
        error = rejected(lambda: bob.sessions())
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "not valid" in error.details()
        tokens = running.tokens()
        wait_for(lambda: running.tokens() > tokens, 30, "bob's stream to go on after the reload")
        assert running.error is None
        # A file that does not parse keeps the keys in force.
        keys_path.write_text(f"{KEYS['alice']} alice\nnot a key line\n")
        assert not pool.call(pool.pool.reload_keys)
        assert carol.pool_status() and alice.pool_status()
        assert ("onestream_router_user_requests_total", "carol", None) in user_counters(pool)
    finally:
        stop(bob, running)
        key_file(keys_path, "alice", "bob", "ops")
        pool.call(pool.pool.reload_keys)
    wait_until_idle(pool)


def test_a_raw_stub_with_metadata_is_all_a_grpc_client_needs(pool: PoolThread) -> None:
    """What a client in another language does: the key as `authorization` call metadata."""
    with grpc.insecure_channel(pool.grpc_address) as channel:
        stub = pb_grpc.OneStreamStub(channel)
        info = stub.GetModelInfo(
            pb.GetModelInfoRequest(), metadata=[("authorization", f"Bearer {KEYS['alice']}")], timeout=30
        )
        assert info.max_context == MAX_CONTEXT


# ---- the same rules over HTTP ---------------------------------------------------------------------
def test_http_callers_need_a_valid_key(pool: PoolThread) -> None:
    wrong = secrets.token_urlsafe(24)
    intruder = http_client(pool, wrong)
    for call in (intruder.models.list, lambda: chat(intruder)):
        with pytest.raises(openai.AuthenticationError) as refused:
            call()
        assert refused.value.status_code == 401
        assert "the API key is not valid" in str(refused.value) and wrong not in str(refused.value)
    bare = urllib.request.Request(
        f"http://{pool.http_address}/v1/chat/completions",
        data=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bare, timeout=60)
    assert refused.value.code == 401 and b"needs an API key" in refused.value.read()
    # Anthropic's SDKs send the key as x-api-key.
    anthropic_style = urllib.request.Request(
        f"http://{pool.http_address}/v1/models", headers={"x-api-key": KEYS["alice"]}
    )
    with urllib.request.urlopen(anthropic_style, timeout=60) as response:
        assert response.status == 200
    assert chat(http_client(pool, KEYS["alice"])).usage.completion_tokens > 0
    claude = claude_client(pool, wrong)

    def count() -> Any:
        return claude.messages.count_tokens(
            model="default_model", messages=[{"role": "user", "content": "hi"}]
        )

    for call in (lambda: message(claude), count):
        with pytest.raises(anthropic.AuthenticationError) as denied:
            call()
        assert denied.value.status_code == 401 and wrong not in str(denied.value)
    assert message(claude_client(pool, KEYS["alice"])).usage.output_tokens > 0
    # The context length is known by now (alice's turns); a prompt past it from a bad key still hears 401
    # first, not the window's size.
    too_long = [{"role": "user", "content": "word " * (2 * MAX_CONTEXT)}]
    with pytest.raises(openai.AuthenticationError) as refused:
        intruder.chat.completions.create(model="m", messages=too_long)  # type: ignore[arg-type]
    assert refused.value.status_code == 401 and str(MAX_CONTEXT) not in str(refused.value)
    with pytest.raises(openai.BadRequestError) as too_big:
        http_client(pool, KEYS["alice"]).chat.completions.create(model="m", messages=too_long)  # type: ignore[arg-type]
    assert too_big.value.code == "context_length_exceeded"


def test_http_turns_on_another_users_session_are_forbidden(pool: PoolThread) -> None:
    alice, bob = http_client(pool, KEYS["alice"]), http_client(pool, KEYS["bob"])
    assert chat(alice, "alice-http").choices[0].message.content is not None
    with pytest.raises(openai.PermissionDeniedError) as refused:
        chat(bob, "alice-http")
    assert refused.value.status_code == 403 and "belongs to another user" in str(refused.value)
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        message(claude_client(pool, KEYS["bob"]), "alice-http")
    assert denied.value.status_code == 403 and "belongs to another user" in str(denied.value)
    wait_until_idle(pool)


def test_http_over_a_users_limit_is_429_with_retry_after(
    pool: PoolThread, clients: dict[str, PoolClient]
) -> None:
    bobs = [Stream(clients["bob"], long_turn(f"bob-http-{i}")) for i in range(USER_MAX_CONCURRENT)]
    try:
        for stream in bobs:
            assert stream.started.wait(60) and stream.error is None
        with pytest.raises(openai.RateLimitError) as refused:
            chat(http_client(pool, KEYS["bob"]))
        assert refused.value.status_code == 429
        assert refused.value.response.headers["retry-after"] == str(RETRY_AFTER_S)
        assert "--user-max-concurrent" in str(refused.value)
        with pytest.raises(anthropic.RateLimitError) as limited:
            message(claude_client(pool, KEYS["bob"]))
        assert limited.value.status_code == 429
        assert limited.value.response.headers["retry-after"] == str(RETRY_AFTER_S)
    finally:
        stop(clients["bob"], *bobs)
    wait_until_idle(pool)

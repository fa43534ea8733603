"""The pool against an adversarial client: oversized fields, bytes that are no message, a session
closed during its own turn, and property-based fuzzing of every RPC's request. A real one-node Ray
cluster with one CPU card and a short context (so that any generation a fuzzed request starts is short).
Every refusal must be INVALID_ARGUMENT (or the code the API promises), never UNKNOWN or INTERNAL, with
a short message, and leave the pool healthy."""

from __future__ import annotations

import logging
import time
import urllib.request
import uuid
from typing import Any

import grpc
import pytest
import ray
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onestream.cluster import wire
from onestream.cluster.client import PoolClient, make_request
from onestream.cluster.health import SERVICE as HEALTH_SERVICE
from onestream.cluster.limits import MAX_ABORT_IDS
from onestream.cluster.server import PoolThread
from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.worker.api import MAX_ID_CHARS, PROMPT_BYTES_PER_TOKEN
from pool_helpers import assert_idle

pytestmark = pytest.mark.slow

MAX_CONTEXT = 128
WAIT_S = 180.0
MAX_DETAILS_CHARS = 400  # a status message must fit any client's metadata limit, whatever was sent
SERVICE = pb.DESCRIPTOR.services_by_name["OneStream"]
REFLECTION_SERVICE = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
# Every method the server exposes, by "Service/Method": the pool's own, grpc's health and reflection.
METHODS = {
    f"{service.name}/{method.name}": method
    for service in (SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE)
    for method in service.methods
}
CLIENT_ERROR_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


# ---- fixtures (tests/conftest.py builds the cluster, the router and the client from these) ---------
@pytest.fixture(scope="module")
def pool_cards() -> tuple[int, ...]:
    return (1,)


@pytest.fixture(scope="module")
def pool_settings() -> dict[str, Any]:
    return {
        "card_metrics_host": "127.0.0.1",  # not the node's address: the option is honoured
        "engine_options": {"max_context": MAX_CONTEXT},
        "queue_capacity": 4,
        "first_token_timeout_s": 60.0,
        "token_timeout_s": 30.0,
    }


def generate(
    client: PoolClient, request: pb.GenerateRequest
) -> tuple[list[pb.GenerateResponse], grpc.RpcError | None]:
    events: list[pb.GenerateResponse] = []
    try:
        for event in client.generate(request, timeout_s=WAIT_S):
            events.append(event)
    except grpc.RpcError as e:
        return events, e
    return events, None


def raw_call(client: PoolClient, method: str, data: bytes) -> grpc.RpcError | None:
    """Send `data` as the request bytes of `method` ("Service/Method" of any service the server exposes);
    the error it ends with (None: it succeeded). A stream that never ends (Health/Watch) is read to its
    first message."""
    descriptor = METHODS[method]
    path = f"/{descriptor.containing_service.full_name}/{descriptor.name}"
    streams = (descriptor.client_streaming, descriptor.server_streaming)
    make = {
        (False, False): client.channel.unary_unary,
        (False, True): client.channel.unary_stream,
        (True, True): client.channel.stream_stream,
    }[streams]
    call = make(path, request_serializer=None, response_deserializer=None)
    try:
        result = call(iter([data]) if descriptor.client_streaming else data, timeout=WAIT_S)
        if descriptor.server_streaming:
            for _ in result:
                if method == "Health/Watch":
                    result.cancel()
                    break
    except grpc.RpcError as e:
        return e
    return None


def assert_client_error(error: grpc.RpcError | None, *fragments: str) -> None:
    assert error is not None, "the request should have been refused"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert len(error.details()) <= MAX_DETAILS_CHARS, error.details()[:MAX_DETAILS_CHARS]
    for fragment in fragments:
        assert fragment in error.details(), error.details()


# ---- bounds -------------------------------------------------------------------------------------
def with_logit_bias(request: pb.GenerateRequest, bias: dict[int, float]) -> pb.GenerateRequest:
    request.sampling.logit_bias.update(bias)
    return request


HUGE = "x" * (1 << 20)
OVERSIZED: list[tuple[str, Any, tuple[str, ...]]] = [
    ("20 MB text prompt", lambda: make_request("y" * (20 << 20), max_tokens=4), ("text prompt", "bytes")),
    (
        "chat contents over the byte bound",
        lambda: make_request([{"role": "user", "content": "z" * (MAX_CONTEXT * PROMPT_BYTES_PER_TOKEN + 1)}]),
        ("messages' contents", str(MAX_CONTEXT * PROMPT_BYTES_PER_TOKEN)),
    ),
    (
        "more messages than the context holds",
        lambda: make_request([{"role": "user", "content": "a"}] * (MAX_CONTEXT + 1), max_tokens=4),
        ("messages has", str(MAX_CONTEXT)),
    ),
    ("1 MB chat role", lambda: make_request([{"role": HUGE, "content": "a"}], max_tokens=4), ("role",)),
    (
        "1 MB session id",
        lambda: make_request("hi", session_id=HUGE, max_tokens=4),
        ("session_id", str(MAX_ID_CHARS)),
    ),
    (
        "1 MB request id",
        lambda: make_request("hi", request_id=HUGE, max_tokens=4),
        ("request_id", str(MAX_ID_CHARS)),
    ),
    ("100k stop strings", lambda: make_request("hi", stop=["s"] * 100_000, max_tokens=4), ("stop has",)),
    ("1 MB stop string", lambda: make_request("hi", stop=[HUGE], max_tokens=4), ("stop[0]",)),
    ("100k stop token ids", lambda: make_request("hi", stop_token_ids=[1] * 100_000), ("stop_token_ids",)),
    (
        "100k logit biases",
        lambda: with_logit_bias(make_request("hi", max_tokens=4), {i: 1.0 for i in range(100_000)}),
        ("logit_bias",),
    ),
    ("1M prompt tokens", lambda: make_request([1] * 1_000_000, max_tokens=4), ("exceeds the context",)),
]


@pytest.mark.parametrize(("factory", "fragments"), [c[1:] for c in OVERSIZED], ids=[c[0] for c in OVERSIZED])
def test_oversized_fields_are_refused_early_naming_the_field_and_the_limit(
    client: PoolClient, factory: Any, fragments: tuple[str, ...]
) -> None:
    started = time.monotonic()
    events, error = generate(client, factory())
    assert_client_error(error, *fragments)
    assert not events, "refused before queueing: not even a queue position"
    assert time.monotonic() - started < 10, "refused by a length check, not after work"
    assert_idle(client)


def test_a_deadline_timestamp_out_of_range_is_invalid_argument(client: PoolClient) -> None:
    for seconds, nanos in ((1 << 62, 0), (-(1 << 62), 0), (10, 2_000_000_000), (10, -1)):
        request = make_request("hi", max_tokens=4)
        request.deadline.seconds, request.deadline.nanos = seconds, nanos
        _, error = generate(client, request)
        assert_client_error(error, "deadline")


def test_close_session_and_abort_bound_their_ids_and_never_echo_them(client: PoolClient) -> None:
    with pytest.raises(grpc.RpcError) as error:
        client.close_session(HUGE)
    assert_client_error(error.value, "session_id", str(MAX_ID_CHARS))
    with pytest.raises(grpc.RpcError) as error:
        client.close_session("")
    assert_client_error(error.value, "session_id is empty")
    with pytest.raises(grpc.RpcError) as error:
        client.abort(*[f"r{i}" for i in range(MAX_ABORT_IDS + 1)])
    assert_client_error(error.value, "request_ids", str(MAX_ABORT_IDS))
    with pytest.raises(grpc.RpcError) as error:
        client.abort("ok", HUGE)
    assert_client_error(error.value, "request_ids[1]")
    assert client.abort(*[f"r{i}" for i in range(MAX_ABORT_IDS)]) == []


# ---- bytes that are no message ------------------------------------------------------------------
BAD_UTF8_SESSION = b"\x0a\x02\xff\xfe"  # field 1 (a string in every request that has one): not UTF-8
MALFORMED = {
    "invalid UTF-8 in a string field": BAD_UTF8_SESSION,
    "truncated length-delimited field": b"\x0a\x05ab",
    "corrupt wire format": b"\xff\xff\xff\xff",
}


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("data", list(MALFORMED.values()), ids=list(MALFORMED))
def test_bytes_that_are_no_request_get_invalid_argument(
    client: PoolClient, method: str, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=wire.__name__)
    error = raw_call(client, method, data)
    assert not [r for r in caplog.records if r.exc_info], "a refused request logs no traceback"
    if not METHODS[method].input_type.fields and data == BAD_UTF8_SESSION:
        # The request has no fields: an unknown field 1 of any bytes is skipped, as protobuf does.
        assert error is None
        return
    assert_client_error(error, "malformed request")
    logged = [r.getMessage() for r in caplog.records if r.name == wire.__name__]
    assert len(logged) == 1 and logged[0].startswith(
        f"client error: {method.replace('/', '.')}: INVALID_ARGUMENT"
    )


def test_a_malformed_chat_message_in_a_valid_request_is_invalid_argument(client: PoolClient) -> None:
    valid = make_request([{"role": "user", "content": "hi"}], max_tokens=4).SerializeToString()
    # Field 4 (messages) holds a ChatMessages whose one message's role is not UTF-8.
    inner = b"\x0a\x04" + b"\x0a\x02\xc3\x28"
    error = raw_call(client, "OneStream/Generate", valid + b"\x22" + bytes([len(inner)]) + inner)
    assert_client_error(error, "malformed request")
    assert_idle(client)


# ---- the close-during-turn race -----------------------------------------------------------------
def test_a_session_closed_during_its_turn_stays_closed(pool: PoolThread, client: PoolClient) -> None:
    session = f"s-{uuid.uuid4().hex[:8]}"
    _, error = generate(client, make_request("def f():", session_id=session, max_tokens=4, temperature=0.0))
    assert error is None
    turn = client.generate(
        make_request(
            "def f():\n    return 1", session_id=session, max_tokens=MAX_CONTEXT - 24, ignore_eos=True
        ),
        timeout_s=WAIT_S,
    )
    events = iter(turn)
    while next(events).WhichOneof("event") != "chunk":  # the turn is generating
        pass
    home = client.close_session(session)  # answers once the card dropped the state: after the turn
    finished = [e for e in events if e.WhichOneof("event") == "finished"]
    assert finished and finished[0].finished.card.card_id == home, "the turn itself finishes"
    assert session not in {s.session_id for s in client.sessions()}
    actor = pool.call(pool.pool.registry.actor, home)
    assert session not in {s.session_id for s in ray.get(actor.sessions.remote(), timeout=30)}
    with pytest.raises(grpc.RpcError) as again:
        client.close_session(session)
    assert again.value.code() == grpc.StatusCode.NOT_FOUND
    assert_idle(client)


# ---- memory per stream ---------------------------------------------------------------------------
STREAMS = 40
MAX_GROWTH_MB = 4.0  # 100 KB a stream; the leak issue 26 measured was 200 KB a stream (12 MB per 60)


def test_a_cards_memory_does_not_grow_with_streams_whose_sessions_are_closed(
    pool: PoolThread, client: PoolClient
) -> None:
    def card_rss_mb() -> float:
        (card_id,) = pool.call(pool.pool.registry.live_cards)
        status = ray.get(pool.call(pool.pool.registry.actor, card_id).status.remote(), timeout=60)
        return status["rss_bytes"] / 1e6

    def streams(count: int) -> None:
        for i in range(count):
            session = f"m-{uuid.uuid4().hex[:8]}"
            for turn in range(2):
                prompt = f"def f{i}(x):\n" + "    x += 1\n" * turn
                _, error = generate(
                    client, make_request(prompt, session_id=session, max_tokens=8, ignore_eos=True)
                )
                assert error is None, error
            client.close_session(session)

    streams(10)  # allocator pools, caches and Ray's buffers fill first
    before = card_rss_mb()
    streams(STREAMS)
    grown = card_rss_mb() - before
    print(f"card memory after {2 * STREAMS} streams ({STREAMS} sessions, closed): {grown:+.1f} MB")
    assert grown < MAX_GROWTH_MB
    assert not [s for s in client.sessions() if s.session_id.startswith("m-")], "every session was closed"


# ---- property-based fuzzing ---------------------------------------------------------------------
def _messages() -> st.SearchStrategy[Any]:
    """Request messages of every RPC, with fields drawn over their whole ranges."""
    text = st.text(max_size=64)
    sampling = st.builds(
        pb.SamplingParams,
        temperature=st.floats(allow_nan=True, width=32) | st.none(),
        top_k=st.integers(-(1 << 31), (1 << 31) - 1) | st.none(),
        top_p=st.floats(width=32) | st.none(),
        repetition_penalty=st.floats(width=32) | st.none(),
        seed=st.integers(0, (1 << 64) - 1) | st.none(),
    )
    messages = st.lists(
        st.builds(pb.ChatMessage, role=st.sampled_from(["user", "system", "robot", ""]) | text, content=text),
        max_size=4,
    )

    def generate_request(prompt: Any, **fields: Any) -> pb.GenerateRequest:
        request = pb.GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
        kind, value = prompt
        if kind == "text":
            request.text = value
        elif kind == "ids":
            request.token_ids.ids.extend(value)
        elif kind == "messages":
            request.messages.messages.extend(value)
        return request

    prompts = st.one_of(
        st.tuples(st.just("text"), text),
        st.tuples(st.just("ids"), st.lists(st.integers(0, (1 << 32) - 1), max_size=8)),
        st.tuples(st.just("messages"), messages),
        st.tuples(st.just("none"), st.none()),
    )
    generate = st.builds(
        generate_request,
        prompts,
        session_id=text | st.none(),
        sampling=sampling | st.none(),
        max_tokens=st.integers(-(1 << 31), (1 << 31) - 1) | st.sampled_from([1, 2, 4]) | st.none(),
        stop=st.lists(text, max_size=3),
        stop_token_ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=3),
        request_id=text | st.none(),
        ignore_eos=st.booleans(),
        deadline=st.builds(
            Timestamp,
            seconds=st.integers(-(1 << 63), (1 << 63) - 1),
            nanos=st.integers(-(1 << 31), (1 << 31) - 1),
        )
        | st.none(),
    )
    return st.one_of(
        st.tuples(st.just("OneStream/Generate"), generate),
        st.tuples(
            st.just("OneStream/Abort"), st.builds(pb.AbortRequest, request_ids=st.lists(text, max_size=4))
        ),
        st.tuples(st.just("OneStream/CloseSession"), st.builds(pb.CloseSessionRequest, session_id=text)),
    )


def _methods_and_bytes() -> st.SearchStrategy[tuple[str, bytes]]:
    """Any method with any bytes, or a valid message's bytes cut, flipped or extended."""
    arbitrary = st.tuples(st.sampled_from(list(METHODS)), st.binary(max_size=64))

    def mangled(drawn: tuple[tuple[str, Any], int, int]) -> tuple[str, bytes]:
        (method, message), at, flip = drawn
        data = bytearray(message.SerializeToString())
        if data:
            i = at % len(data)
            data[i] ^= flip or 0x80
        return method, bytes(data[: max(len(data) - at % 3, 0)])

    return arbitrary | st.tuples(_messages(), st.integers(0, 1 << 16), st.integers(0, 255)).map(mangled)


FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(call=_messages())
def test_fuzzed_requests_never_answer_unknown_or_internal(client: PoolClient, call: tuple[str, Any]) -> None:
    method, message = call
    error = raw_call(client, method, message.SerializeToString())
    if error is not None:
        assert error.code() in CLIENT_ERROR_CODES, (error.code(), error.details())
        assert len(error.details()) <= MAX_DETAILS_CHARS
    assert_idle(client)


@FUZZ
@given(call=_methods_and_bytes())
def test_fuzzed_bytes_never_answer_unknown_or_internal(client: PoolClient, call: tuple[str, bytes]) -> None:
    method, data = call
    error = raw_call(client, method, data)
    if error is not None:
        assert error.code() in CLIENT_ERROR_CODES, (error.code(), error.details())
        assert len(error.details()) <= MAX_DETAILS_CHARS
    assert_idle(client)


def test_card_metrics_bind_to_the_chosen_interface(client: PoolClient) -> None:
    (card,) = client.cards()
    host, _, port = card.metrics_endpoint.rpartition(":")
    assert host == "127.0.0.1" and port.isdigit(), card.metrics_endpoint
    with urllib.request.urlopen(f"http://{card.metrics_endpoint}/metrics", timeout=30) as response:
        assert b"onestream_" in response.read()

"""Serving a servicer so that a request that cannot be parsed is a client error, not a server one.

grpcio's generated handlers deserialize with `FromString`, whose DecodeError (invalid UTF-8 in a string
field, a corrupt message) grpc answers UNKNOWN after logging a traceback. `add_servicer` builds the
handlers from the service descriptor instead, with a parser that hands a `Malformed` marker to the
method's guard, which answers INVALID_ARGUMENT and logs one line. It serves any servicer of the aio
shape (the pool's own, grpc's health and reflection servicers): every arity, methods that are
coroutines or async generators; a request stream is checked message by message.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

log = logging.getLogger(__name__)
# The largest message any of the pool's gRPC servers and channels sends or accepts: requests are bounded by
# field (cluster/limits.py) well below it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A stream can be quiet for minutes (a long prefill, a queue wait): every channel pings its server this
# often so that a peer that vanished without a reset is noticed.
KEEPALIVE_TIME_MS = 20_000
# How often a server lets a client ping. gRPC's default (5 minutes) counts each quicker ping on a quiet
# connection as a strike and at the third answers GOAWAY too_many_pings, killing the streams in flight.
MIN_PING_INTERVAL_MS = 1_000
# A channel whose server went away retries with exponential backoff, up to gRPC's default 120 s, and fails
# every call at once until the next try: a client that called while the router restarted would find it
# back only minutes later. Capped, a restarted router is reached within about this long.
MAX_RECONNECT_BACKOFF_MS = 2_000


def channel_options() -> list[tuple[str, int]]:
    """Options for every gRPC channel of the pool: message bounds, keepalive pings even when quiet
    (`KEEPALIVE_TIME_MS`, read when the channel is made), and reconnection tries at most
    `MAX_RECONNECT_BACKOFF_MS` apart."""
    return [
        ("grpc.initial_reconnect_backoff_ms", min(250, MAX_RECONNECT_BACKOFF_MS)),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]


def server_options() -> list[tuple[str, int]]:
    """Options for every gRPC server of the pool: a channel's, and its clients' pings accepted."""
    return [*channel_options(), ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS)]


@dataclass(frozen=True)
class Malformed:
    """What the parser returns for bytes that are not a valid request message."""

    message_type: str
    error: str


def add_servicer(servicer: Any, server: grpc.aio.Server, service: ServiceDescriptor) -> None:
    """Register every method of `service` on `server`, served by the same-named coroutine of `servicer`."""
    handlers = {}
    for method in service.methods:
        request_class = GetMessageClass(method.input_type)
        response_class = GetMessageClass(method.output_type)
        make = _HANDLERS[(method.client_streaming, method.server_streaming)]
        guard = _guarded_stream if method.client_streaming else _guarded
        handlers[method.name] = make(
            guard(f"{service.name}.{method.name}", getattr(servicer, method.name)),
            request_deserializer=_parser(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def add_health_and_reflection(server: grpc.aio.Server, health: Any, service_names: list[str]) -> None:
    """grpc's health servicer and server reflection (listing `service_names`, health and itself), each
    registered through `add_servicer`: grpc's own registration answers malformed bytes UNKNOWN."""
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    from .health import SERVICE as health_service

    reflection_service = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
    add_servicer(health, server, health_service)
    listed = [*service_names, health_service.full_name, reflection_service.full_name]
    add_servicer(reflection.aio.ReflectionServicer(listed), server, reflection_service)


def client_error(rpc: str, code: grpc.StatusCode, message: str) -> None:
    """The one log line of a request the pool refused as the client's fault."""
    log.info("client error: %s: %s: %s", rpc, code.name, message)


def _parser(message_class: type[Message]) -> Callable[[bytes], Message | Malformed]:
    def parse(data: bytes) -> Message | Malformed:
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            return Malformed(message_class.DESCRIPTOR.full_name, str(e).splitlines()[0] if str(e) else "")

    return parse


def _guarded(rpc: str, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """A method taking one request: a malformed one is refused before `behaviour` sees it."""
    if inspect.isasyncgenfunction(behaviour):

        async def guarded_generator(request: Message | Malformed, context: Any) -> AsyncIterator[Any]:
            await _refuse_malformed(rpc, request, context)
            async for response in behaviour(request, context):
                yield response

        guarded_generator.__name__ = rpc
        return guarded_generator

    async def guarded(request: Message | Malformed, context: Any) -> Any:
        await _refuse_malformed(rpc, request, context)
        result = behaviour(request, context)
        return await result if inspect.isawaitable(result) else result

    guarded.__name__ = rpc
    return guarded


def _guarded_stream(rpc: str, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """A method taking a request stream: the call ends INVALID_ARGUMENT at the first malformed message."""

    async def checked(requests: AsyncIterable[Message | Malformed], context: Any) -> AsyncIterator[Message]:
        async for request in requests:
            await _refuse_malformed(rpc, request, context)
            yield request  # type: ignore[misc]

    if inspect.isasyncgenfunction(behaviour):

        async def guarded_generator(requests: AsyncIterable[Any], context: Any) -> AsyncIterator[Any]:
            async for response in behaviour(checked(requests, context), context):
                yield response

        guarded_generator.__name__ = rpc
        return guarded_generator

    async def guarded(requests: AsyncIterable[Any], context: Any) -> Any:
        result = behaviour(checked(requests, context), context)
        return await result if inspect.isawaitable(result) else result

    guarded.__name__ = rpc
    return guarded


async def _refuse_malformed(rpc: str, request: Message | Malformed, context: Any) -> None:
    if isinstance(request, Malformed):
        message = f"malformed request: {request.error}"
        client_error(rpc, grpc.StatusCode.INVALID_ARGUMENT, message)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


_HANDLERS = {  # (request streaming, response streaming) -> grpc's handler factory
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}

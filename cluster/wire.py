"""Serving a servicer so that a request that cannot be parsed is a client error, not a server one.

grpcio's generated handlers deserialize with `FromString`, whose DecodeError (invalid UTF-8 in a string
field, a corrupt message) grpc answers UNKNOWN after logging a traceback. `add_servicer` builds the
handlers from the service descriptor instead, with a parser that hands a `Malformed` marker to the
method's guard, which answers INVALID_ARGUMENT and logs one line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

log = logging.getLogger(__name__)


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
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            _guarded(service.name, method.name, getattr(servicer, method.name)),
            request_deserializer=_parser(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


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


def _guarded(service: str, name: str, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def guarded(request: Message | Malformed, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            message = f"malformed request: {request.error}"
            client_error(f"{service}.{name}", grpc.StatusCode.INVALID_ARGUMENT, message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        return await behaviour(request, context)

    guarded.__name__ = name
    return guarded

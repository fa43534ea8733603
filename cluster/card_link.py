"""The data path between the router and a card: a direct gRPC stream per generation.

Ray places, watches and restarts the cards; the tokens they make travel on this link instead of Ray's
object stream, which costs about a millisecond per item and per call (docs/benchmarks.md, session 21).
Each card serves one unary-stream method on its node (`LinkServer`, in the actor's event loop); the router
keeps one channel per card (`CardLink`). The messages are pickled engine objects (`GenerateRequest` in,
`TokenChunk` / `Finished` / `CardError` / `PrefixReport` out), so the link trusts its peer as Ray does:
each card draws a random token per incarnation, hands it to the router over Ray with its identity, and
unpickles nothing from a call that does not carry it.
"""

from __future__ import annotations

import asyncio
import hmac
import pickle
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from .wire import channel_options, server_options

SERVICE = "onestream.card.v1.CardLink"
METHOD = f"/{SERVICE}/Generate"
TOKEN_HEADER = "onestream-card-token"
# The card's side failed (a bug, a token mismatch): the request cannot succeed on a retry elsewhere.
_FAILED_CODES = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

Items = Callable[[Any], AsyncIterator[object]]


def new_token() -> str:
    return secrets.token_urlsafe(24)


class LinkLost(Exception):
    """The card went away under the call (its process died, its node left): the card is down."""


class LinkFailed(Exception):
    """The card answered the call with an error of its own (a bug on the card, or a wrong token)."""


class LinkServer:
    """The card's end: serves `items(request)` for every authenticated call, pickled one by one."""

    def __init__(self, host: str, token: str, items: Items) -> None:
        self.token = token
        self._token = token.encode()
        self._items = items
        self._server = grpc.aio.server(options=server_options())
        handler = grpc.method_handlers_generic_handler(
            SERVICE, {"Generate": grpc.unary_stream_rpc_method_handler(self._generate)}
        )
        self._server.add_generic_rpc_handlers((handler,))
        port = self._server.add_insecure_port(f"{_bracketed(host)}:0")
        self.endpoint = f"{_bracketed(host)}:{port}"

    async def start(self) -> None:
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(grace=None)

    async def _generate(self, payload: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        given = dict(context.invocation_metadata() or ()).get(TOKEN_HEADER, "")
        if not hmac.compare_digest(str(given).encode(), self._token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the card link's token is missing or wrong")
        headers: asyncio.Future[None] | None = None
        try:
            request = pickle.loads(payload)
            # The call's headers go out while the engine works (the task runs once the loop below waits for
            # the first item, the engine started), not with the first item: the router reads it at once.
            headers = asyncio.ensure_future(context.send_initial_metadata(()))
            headers.add_done_callback(_retrieved)
            async for item in self._items(request):
                await headers  # done by now
                yield pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
            await headers  # a call that ends without items
        except Exception as e:  # a bug on the card (or the router): the router answers INTERNAL naming it
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            if headers is not None:
                headers.cancel()  # the call was cancelled: no-op when sent


class LinkCall:
    """One generation's stream from a card; `cancel` ends it on both sides (the card stops the engine at
    the next token boundary)."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def next(self) -> object:
        """The next item; StopAsyncIteration at the end, LinkLost or LinkFailed on an error."""
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise _link_error(e) from e
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        return pickle.loads(message)

    def cancel(self) -> None:
        self._call.cancel()


class CardLink:
    """The router's end: one channel to one card incarnation's `LinkServer`."""

    def __init__(self, endpoint: str, token: str) -> None:
        self.endpoint = endpoint
        self._channel = grpc.aio.insecure_channel(endpoint, options=channel_options())
        self._generate = self._channel.unary_stream(METHOD)
        self._metadata = ((TOKEN_HEADER, token),)

    def generate(self, request: Any) -> LinkCall:
        """Start a generation on the card; the request is on its way when this returns."""
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        return LinkCall(self._generate(payload, metadata=self._metadata))

    async def close(self) -> None:
        await self._channel.close(grace=None)


def _link_error(error: grpc.aio.AioRpcError) -> Exception:
    details = error.details() or error.code().name
    if error.code() in _FAILED_CODES:
        return LinkFailed(details)
    return LinkLost(f"{error.code().name}: {details}")


def _retrieved(task: asyncio.Future[None]) -> None:
    """Marks a headers task's failure seen: a call cancelled before its first item does not wait for it."""
    if not task.cancelled():
        task.exception()


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host

"""The router, as the front door calls it: the pool's own gRPC servicer, in this process, with the caller's
credentials.

The front door runs in the router's process and event loop, so it calls the servicer's methods directly
instead of over a loopback gRPC channel (which cost each HTTP turn about a millisecond of serialisation and
hops: docs/benchmarks.md). `_Context` is the part of `grpc.aio.ServicerContext` the router uses; everything a
gRPC client sees is kept: the caller's metadata, the router's aborts with their code, message and trailing
metadata, its streamed messages in order, and cancellation when the HTTP client goes away (which frees the
card at once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from onestream.protos.onestream.v1 import onestream_pb2 as pb

from .errors import ApiError, from_status

log = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str]]
# Messages the router may write ahead of the HTTP side before its writes wait (a gRPC stream's flow
# control would hold it back the same way).
STREAM_BUFFER = 64


def credentials(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The call metadata carrying the HTTP caller's key: `Authorization: Bearer` as sent, or Anthropic's
    `x-api-key` as a bearer token (the router checks it, for both doors alike)."""
    authorization = headers.get("Authorization")
    if authorization:
        return [("authorization", authorization)]
    key = headers.get("x-api-key")
    return [("authorization", f"Bearer {key}")] if key else []


class _Aborted(Exception):
    """The router ended the call with a status (what `context.abort` raises under gRPC)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Metadata) -> None:
        super().__init__(details)
        self.error = from_status(code, details, trailing)


class _Context:
    """What the router's methods use of a gRPC servicer context, for a call made in this process."""

    def __init__(self, metadata: Metadata, write: Callable[[Any], Awaitable[None]] | None = None) -> None:
        self._metadata = tuple(metadata)
        self._write = write
        self._cancelled = False

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None  # the front door sets no deadline of its own; a request's `deadline` field still counts

    def cancelled(self) -> bool:
        return self._cancelled

    async def write(self, message: Any) -> None:
        if self._write is None:
            raise RuntimeError("a unary call writes no stream")
        await self._write(message)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Metadata = ()) -> None:
        raise _Aborted(code, details, trailing_metadata)


class InProcessRouter:
    """The router's servicer (cluster/router.Router), called in process."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer

    async def model_info(self, metadata: Metadata = ()) -> pb.ModelInfo:
        try:
            return await self.servicer.GetModelInfo(pb.GetModelInfoRequest(), _Context(metadata))
        except _Aborted as e:
            raise e.error from None

    def generate(self, request: pb.GenerateRequest, metadata: Metadata = ()) -> Turn:
        """Start the router's Generate for `request` now (in this event loop); the turn reads its stream."""
        return Turn(_Call(self.servicer.Generate, request, metadata))


_END = object()


class _Call:
    """One Generate running as a task of this loop: its messages through a bounded queue, then its end (the
    queue's `_END`, or the `ApiError` it ended with)."""

    def __init__(
        self, method: Callable[..., Awaitable[None]], request: pb.GenerateRequest, metadata: Metadata
    ) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue(STREAM_BUFFER)
        self._context = _Context(metadata, self._queue.put)
        self._ended = False
        self._task = asyncio.get_running_loop().create_task(self._run(method, request))

    async def _run(self, method: Callable[..., Awaitable[None]], request: pb.GenerateRequest) -> None:
        try:
            await method(request, self._context)
            end: Any = _END
        except _Aborted as e:
            end = e.error
        except asyncio.CancelledError:
            raise  # cancel(): nobody reads the end
        except Exception as e:  # a bug in the router: what a gRPC client would hear as UNKNOWN
            log.exception("the router's Generate failed")
            end = ApiError(500, f"the router failed: {type(e).__name__}: {e}")
        await self._queue.put(end)

    async def read(self) -> pb.GenerateResponse | None:
        """The next message; None once the call ended well; raises the ApiError it ended with."""
        if self._ended:
            return None
        item = await self._queue.get()
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, ApiError):
            self._ended = True
            raise item
        return item

    def cancel(self) -> None:
        """End the call now: the router's task is cancelled, which frees its card."""
        self._context._cancelled = True
        self._task.cancel()


class Turn:
    """One Generate call. `admitted()` waits until the router took the turn (queued, or on a card) and
    `assigned()` until a card has it, each raising the call's error as an ApiError (so that a stream can
    still answer with an HTTP status); iterating gives the chunks and the final `finished`. `cancel()`
    ends the call at once (the card is freed)."""

    def __init__(self, call: _Call) -> None:
        self._call = call
        self._held: list[pb.GenerateResponse] = []
        self._queued = False
        self.assignment: pb.Assigned | None = None

    async def admitted(self) -> None:
        await self._advance(until_queued=True)

    async def assigned(self) -> None:
        await self._advance(until_queued=False)

    async def _advance(self, *, until_queued: bool) -> None:
        while self.assignment is None and not self._held and not (until_queued and self._queued):
            message = await self._call.read()
            if message is None:
                raise ApiError(502, "the router ended the turn without an answer")
            kind = message.WhichOneof("event")
            if kind == "assigned":
                self.assignment = message.assigned
            elif kind == "queued":
                self._queued = True
            else:
                self._held.append(message)

    async def events(self) -> AsyncIterator[pb.TokenChunk | pb.Finished]:
        while True:
            message = self._held.pop(0) if self._held else await self._call.read()
            if message is None:
                return
            kind = message.WhichOneof("event")
            if kind == "chunk":
                yield message.chunk
            elif kind == "finished":
                yield message.finished
            elif kind == "assigned":  # a retry on another card before the first token
                self.assignment = message.assigned

    def cancel(self) -> None:
        self._call.cancel()

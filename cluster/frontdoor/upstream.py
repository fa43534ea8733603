"""The router, as the front door calls it: its own gRPC API over loopback, with the caller's credentials."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence

import grpc
from onestream.cluster.wire import channel_options
from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.protos.onestream.v1 import onestream_pb2_grpc as pb_grpc

from .errors import ApiError, from_grpc

Metadata = Sequence[tuple[str, str]]


def credentials(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The call metadata carrying the HTTP caller's key: `Authorization: Bearer` as sent, or Anthropic's
    `x-api-key` as a bearer token (the router checks it, for both doors alike)."""
    authorization = headers.get("Authorization")
    if authorization:
        return [("authorization", authorization)]
    key = headers.get("x-api-key")
    return [("authorization", f"Bearer {key}")] if key else []


class RouterClient:
    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=channel_options())
        self.stub = pb_grpc.OneStreamStub(self.channel)

    async def model_info(self, metadata: Metadata = ()) -> pb.ModelInfo:
        try:
            return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from e

    def generate(self, request: pb.GenerateRequest, metadata: Metadata = ()) -> Turn:
        return Turn(self.stub.Generate(request, metadata=metadata))

    async def close(self) -> None:
        await self.channel.close()


class Turn:
    """One Generate call. `admitted()` waits until the router took the turn (queued, or on a card) and
    `assigned()` until a card has it, each raising the call's error as an ApiError (so that a stream can
    still answer with an HTTP status); iterating gives the chunks and the final `finished`. `cancel()`
    ends the call at once (the card is freed)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
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
            message = await self._read()
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
            message = self._held.pop(0) if self._held else await self._read()
            if message is None:
                return
            kind = message.WhichOneof("event")
            if kind == "chunk":
                yield message.chunk
            elif kind == "finished":
                yield message.finished
            elif kind == "assigned":  # a retry on another card before the first token
                self.assignment = message.assigned

    async def _read(self) -> pb.GenerateResponse | None:
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from e
        return None if message is grpc.aio.EOF else message

    def cancel(self) -> None:
        self._call.cancel()

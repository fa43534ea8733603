"""The router's link to a card (cluster/card_link.py), both ends in one process over real TCP on loopback:
items arrive in order as the card made them, a caller without the card's token is refused before anything
it sent is unpickled, a failure on the card is `LinkFailed` naming it, a card that goes away is `LinkLost`,
cancelling a call ends the card's generation, and a connection that ended cleanly serves the next call."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest
from onestream.cluster import card_link, wire
from onestream.cluster.card_link import (
    CardLink,
    LinkCall,
    LinkFailed,
    LinkLost,
    LinkServer,
    new_token,
)
from onestream.worker.api import Finished, GenerateRequest, Timings, TokenChunk, Usage


class Card:
    """What a card's `_items` does, recorded: requests seen, generations ended."""

    def __init__(
        self, chunks: int = 3, fail_after: int | None = None, forever: bool = False, pause_s: float = 0.0
    ) -> None:
        self.chunks, self.fail_after, self.forever = chunks, fail_after, forever
        self.pause_s = pause_s  # before the first item: a long prefill
        self.requests: list[Any] = []
        self.ended = asyncio.Event()

    async def items(self, request: Any) -> AsyncIterator[object]:
        self.requests.append(request)
        try:
            await asyncio.sleep(self.pause_s)
            i = 0
            while self.forever or i < self.chunks:
                if self.fail_after is not None and i == self.fail_after:
                    raise RuntimeError("the engine broke")
                yield TokenChunk([i], f"t{i}")
                i += 1
                await asyncio.sleep(0.01 if self.forever else 0)
            yield Finished("length", Usage(prompt_tokens=2, generated_tokens=i), Timings())
        finally:
            self.ended.set()


async def drain(call: Any) -> list[object]:
    items = []
    while True:
        try:
            items.append(await call.next())
        except StopAsyncIteration:
            return items


HEADER = struct.Struct("!IB")  # a frame's body length and kind, as the link writes them


async def first_answer(server: LinkServer, sent: bytes) -> tuple[int, str]:
    """The kind and text of the first frame the card answers raw bytes `sent` with."""
    host, port = server.endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(sent)
        length, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
        return kind, (await reader.readexactly(length)).decode()
    finally:
        writer.close()


def run(test: Any) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


class CountingServer(LinkServer):
    """A card's link server that counts the connections it accepted."""

    accepted = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        await super()._serve(reader, writer)


@contextlib.asynccontextmanager
async def linked(card: Card, token: str | None = None) -> AsyncIterator[tuple[CountingServer, CardLink]]:
    """A card's link server on loopback and a router's link to it (with `token`, else the card's own)."""
    card_token = new_token()
    server = CountingServer("127.0.0.1", card_token, card.items)
    await server.start()
    link = CardLink(server.endpoint, card_token if token is None else token)
    try:
        yield server, link
    finally:
        await link.close()
        await server.stop()


def test_items_arrive_in_order_and_the_request_arrives_whole() -> None:
    async def test() -> None:
        card = Card(chunks=4)
        request = GenerateRequest(prompt=[5, 6], session_id="s-1", max_tokens=4)
        async with linked(card) as (_, link):
            items = await drain(link.generate(request))
        assert [i.token_ids for i in items[:-1]] == [[0], [1], [2], [3]]  # type: ignore[attr-defined]
        assert isinstance(items[-1], Finished) and items[-1].usage.generated_tokens == 4
        assert card.requests == [request]

    run(test)


def test_a_caller_without_the_token_is_refused_before_its_request_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loads: list[bytes] = []
    real_loads = pickle.loads
    monkeypatch.setattr(pickle, "loads", lambda data: loads.append(data) or real_loads(data))

    async def test() -> None:
        card = Card()
        for wrong in ("", "x" * 32):
            async with linked(card, token=wrong) as (_, link):
                with pytest.raises(LinkFailed, match="token is missing or wrong"):
                    await link.generate(GenerateRequest(prompt=[1])).next()
        assert card.requests == [] and loads == []  # the card unpickled nothing

    run(test)


def test_a_failure_on_the_card_is_link_failed_naming_it() -> None:
    async def test() -> None:
        async with linked(Card(chunks=5, fail_after=2)) as (_, link):
            call = link.generate(GenerateRequest(prompt=[1]))
            assert (await call.next()).token_ids == [0]  # type: ignore[attr-defined]
            assert (await call.next()).token_ids == [1]  # type: ignore[attr-defined]
            with pytest.raises(LinkFailed, match="RuntimeError: the engine broke"):
                await call.next()

    run(test)


def test_a_card_that_goes_away_mid_stream_is_link_lost() -> None:
    async def test() -> None:
        async with linked(Card(forever=True)) as (server, link):
            call = link.generate(GenerateRequest(prompt=[1]))
            await call.next()
            await server.stop()
            with pytest.raises(LinkLost):
                for _ in range(1000):
                    await call.next()

    run(test)


def test_a_card_nobody_serves_is_link_lost() -> None:
    async def test() -> None:
        async with linked(Card()) as (server, link):
            await server.stop()
            with pytest.raises(LinkLost, match="is gone: ConnectionRefusedError"):
                await link.generate(GenerateRequest(prompt=[1])).next()

    run(test)


def test_cancelling_a_call_ends_the_cards_generation() -> None:
    async def test() -> None:
        card = Card(forever=True)
        async with linked(card) as (_, link):
            call = link.generate(GenerateRequest(prompt=[1]))
            await call.next()
            assert not card.ended.is_set()
            call.cancel()
            await asyncio.wait_for(card.ended.wait(), 5)  # the card's generator ran its `finally`

    run(test)


def test_a_request_the_card_cannot_read_is_link_failed_and_the_card_serves_on() -> None:
    async def test() -> None:
        card = Card()
        async with linked(card) as (_, link):
            with pytest.raises(LinkFailed, match="UnpicklingError"):
                await LinkCall(link, b"not a pickle").next()
            items = await drain(link.generate(GenerateRequest(prompt=[1])))
            assert isinstance(items[-1], Finished)

    run(test)


def test_a_connection_that_ended_cleanly_serves_the_next_call_and_a_cancelled_one_does_not() -> None:
    async def test() -> None:
        card = Card(chunks=2)
        async with linked(card) as (server, link):
            for _ in range(3):
                assert isinstance((await drain(link.generate(GenerateRequest(prompt=[1]))))[-1], Finished)
            assert server.accepted == 1
            call = link.generate(GenerateRequest(prompt=[1]))
            await call.next()
            call.cancel()  # closes its connection: the card stops that generation
            assert isinstance((await drain(link.generate(GenerateRequest(prompt=[2]))))[-1], Finished)
            assert server.accepted == 2
        assert [r.prompt for r in card.requests] == [[1], [1], [1], [1], [2]]

    run(test)


def test_a_reused_connection_the_card_closed_while_idle_is_replaced() -> None:
    async def test() -> None:
        card = Card(chunks=2)
        async with linked(card) as (server, link):
            await drain(link.generate(GenerateRequest(prompt=[1])))
            for writer in list(server._connections):  # the card drops its idle connection
                writer.close()
            await asyncio.sleep(0.05)
            items = await drain(link.generate(GenerateRequest(prompt=[2])))
            assert isinstance(items[-1], Finished) and server.accepted == 2

    run(test)


def test_concurrent_calls_each_take_a_connection_of_their_own() -> None:
    async def test() -> None:
        card = Card(chunks=3)
        async with linked(card) as (server, link):
            results = await asyncio.gather(
                *(drain(link.generate(GenerateRequest(prompt=[i]))) for i in range(3))
            )
        assert all(isinstance(items[-1], Finished) and len(items) == 4 for items in results)
        assert server.accepted == 3

    run(test)


def test_a_frame_over_the_size_limit_is_refused_naming_it() -> None:
    async def test() -> None:
        async with linked(Card()) as (server, _):
            hello = HEADER.pack(len(server.token), card_link.HELLO) + server.token.encode()
            kind, message = await first_answer(
                server, hello + HEADER.pack(wire.MAX_MESSAGE_BYTES + 1, card_link.REQUEST)
            )
        assert kind == card_link.FAILED
        assert (
            message
            == f"link protocol: a frame of {wire.MAX_MESSAGE_BYTES + 1} bytes, over the link's {wire.MAX_MESSAGE_BYTES}"
        )

    run(test)


def test_both_ends_send_at_once_and_keep_quiet_connections_alive() -> None:
    """Nagle's algorithm would hold a token behind the peer's delayed acknowledgement (20-40 ms on a warm
    connection); a long prefill sends nothing for seconds: TCP keepalive, not silence, decides that a peer
    is gone."""

    async def test() -> None:
        async with linked(Card(chunks=2, pause_s=0.5)) as (server, link):
            call = link.generate(GenerateRequest(prompt=[1]))
            assert (await call.next()).token_ids == [0]  # type: ignore[attr-defined]
            ends = [call._opened.result().writer, *server._connections]
            for writer in ends:
                sock = writer.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert (
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == wire.KEEPALIVE_TIME_MS // 1000
                )
            await drain(call)

    run(test)


def test_a_call_ended_at_its_last_item_keeps_its_connection_once_the_card_ends_the_stream() -> None:
    """The router stops reading at the final item (`end`): the card's END is read in the background."""

    async def test() -> None:
        card = Card(chunks=2)
        async with linked(card) as (server, link):
            for prompt in ([1], [2]):
                call = link.generate(GenerateRequest(prompt=prompt))
                while not isinstance(await call.next(), Finished):
                    pass
                call.end()
                await asyncio.wait_for(card.ended.wait(), 5)
                card.ended.clear()
                await asyncio.sleep(0.05)  # the END arrives
            assert server.accepted == 1 and len(link._idle) == 1
            call = link.generate(GenerateRequest(prompt=[3]))
            await call.next()
            call.end()  # not at the last item: the card may still be sending, so the connection closes
            await asyncio.wait_for(card.ended.wait(), 5)
            await drain(link.generate(GenerateRequest(prompt=[4])))
            assert server.accepted == 2

    run(test)


def test_a_caller_must_show_the_token_before_the_card_reads_a_large_frame() -> None:
    async def test() -> None:
        async with linked(Card()) as (server, _):
            # A header announcing too long a token, and no body after it.
            kind, message = await first_answer(
                server, HEADER.pack(card_link.HELLO_LIMIT + 1, card_link.HELLO)
            )
        assert kind == card_link.FAILED
        assert message == f"link protocol: a frame of {card_link.HELLO_LIMIT + 1} bytes, over the link's 1024"

    run(test)


def test_a_request_over_the_frame_limit_is_link_failed_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(card_link, "MAX_MESSAGE_BYTES", 4096)  # above every item here

    async def test() -> None:
        card = Card()
        async with linked(card) as (_, link):
            await drain(link.generate(GenerateRequest(prompt=[1])))  # a connection to reuse
            with pytest.raises(LinkFailed, match="over the link's 4096"):
                await link.generate(GenerateRequest(prompt=list(range(10_000)))).next()
        assert len(card.requests) == 1

    run(test)

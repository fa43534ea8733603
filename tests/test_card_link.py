"""The router's link to a card (cluster/card_link.py), both ends in one process over real gRPC on loopback:
items arrive in order as the card made them, a caller without the card's token is refused before anything
it sent is unpickled, a failure on the card is `LinkFailed` naming it, a card that goes away is `LinkLost`,
and cancelling a call ends the card's generation."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
from collections.abc import AsyncIterator
from typing import Any

import pytest
from onestream.cluster import wire
from onestream.cluster.card_link import (
    METHOD,
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


def run(test: Any) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


@contextlib.asynccontextmanager
async def linked(card: Card, token: str | None = None) -> AsyncIterator[tuple[LinkServer, CardLink]]:
    """A card's link server on loopback and a router's link to it (with `token`, else the card's own)."""
    card_token = new_token()
    server = LinkServer("127.0.0.1", card_token, card.items)
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
            with pytest.raises(LinkLost, match="UNAVAILABLE"):
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
            bad = link._channel.unary_stream(METHOD)(b"not a pickle", metadata=link._metadata)
            with pytest.raises(LinkFailed, match="UnpicklingError"):
                await LinkCall(bad).next()
            items = await drain(link.generate(GenerateRequest(prompt=[1])))
            assert isinstance(items[-1], Finished)

    run(test)


def test_a_stream_quiet_for_many_keepalive_pings_lives(monkeypatch: pytest.MonkeyPatch) -> None:
    # A server that counts the router's keepalive pings as strikes ends a quiet stream (a long prefill)
    # with GOAWAY too_many_pings after the third; pings every second make that happen in 3 s.
    monkeypatch.setattr(wire, "KEEPALIVE_TIME_MS", 1_000)

    async def test() -> None:
        async with linked(Card(chunks=2, pause_s=4.5)) as (_, link):
            items = await drain(link.generate(GenerateRequest(prompt=[1])))
        assert [i.token_ids for i in items[:-1]] == [[0], [1]]  # type: ignore[attr-defined]

    run(test)

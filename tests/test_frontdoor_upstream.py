"""The front door's in-process call of the router's servicer (cluster/frontdoor/upstream.py): what a gRPC client
would hear, from a servicer of the router's shape. The real router behind it: tests/test_frontdoor_http.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from onestream.cluster.auth import RETRY_AFTER
from onestream.cluster.frontdoor.errors import ApiError
from onestream.cluster.frontdoor.upstream import STREAM_BUFFER, InProcessRouter
from onestream.protos.onestream.v1 import onestream_pb2 as pb


def chunk(text: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r", chunk=pb.TokenChunk(text=text))


class Servicer:
    """Generate as the router writes it: messages through `context.write`, an end by returning or aborting."""

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.seen: dict[str, object] = {}

    async def Generate(self, request, context):
        self.seen["metadata"] = context.invocation_metadata()
        self.seen["remaining"] = context.time_remaining()
        await self.behaviour(request, context, self.seen)

    async def GetModelInfo(self, request, context):
        if dict(context.invocation_metadata()).get("authorization") != "Bearer k":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this pool needs an API key")
        return pb.ModelInfo(max_context=4096)


def run(coro):
    return asyncio.run(coro)


def test_a_turn_streams_the_routers_messages_in_order_with_the_callers_metadata() -> None:
    async def behaviour(request, context, seen):
        await context.write(pb.GenerateResponse(request_id="r", assigned=pb.Assigned()))
        for text in ("a", "b", "c"):
            await context.write(chunk(text))
        await context.write(pb.GenerateResponse(request_id="r", finished=pb.Finished(finish_reason="stop")))

    async def main():
        servicer = Servicer(behaviour)
        turn = InProcessRouter(servicer).generate(
            pb.GenerateRequest(request_id="r"), [("authorization", "Bearer k")]
        )
        await turn.admitted()
        await turn.assigned()
        items = [item async for item in turn.events()]
        return servicer.seen, items

    seen, items = run(main())
    assert seen == {"metadata": (("authorization", "Bearer k"),), "remaining": None}
    assert [i.text for i in items[:3]] == ["a", "b", "c"] and items[3].finish_reason == "stop"


def test_an_abort_keeps_its_status_and_retry_hint() -> None:
    async def behaviour(request, context, seen):
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "user u has 4 requests queued", ((RETRY_AFTER, "7"),)
        )

    async def main():
        turn = InProcessRouter(Servicer(behaviour)).generate(pb.GenerateRequest())
        await turn.admitted()

    with pytest.raises(ApiError) as error:
        run(main())
    assert (error.value.status, error.value.message) == (429, "user u has 4 requests queued")
    assert error.value.headers == {"Retry-After": "7"}


def test_a_failing_router_is_a_500_naming_the_failure() -> None:
    async def behaviour(request, context, seen):
        await context.write(pb.GenerateResponse(request_id="r", assigned=pb.Assigned()))
        raise RuntimeError("scheduler lost the card")

    async def main():
        turn = InProcessRouter(Servicer(behaviour)).generate(pb.GenerateRequest())
        await turn.assigned()
        return [item async for item in turn.events()]

    with pytest.raises(ApiError) as error:
        run(main())
    assert error.value.status == 500 and "RuntimeError: scheduler lost the card" in error.value.message


def test_model_info_answers_or_refuses_as_the_router_does() -> None:
    router = InProcessRouter(Servicer(None))
    assert run(router.model_info([("authorization", "Bearer k")])).max_context == 4096
    with pytest.raises(ApiError) as error:
        run(router.model_info())
    assert error.value.status == 401


def test_cancelling_a_turn_cancels_the_routers_task() -> None:
    async def behaviour(request, context, seen):
        await context.write(pb.GenerateResponse(request_id="r", assigned=pb.Assigned()))
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen["cancelled"] = context.cancelled()
            raise

    async def main():
        servicer = Servicer(behaviour)
        turn = InProcessRouter(servicer).generate(pb.GenerateRequest())
        await turn.assigned()
        turn.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        return servicer.seen

    assert run(main())["cancelled"] is True


def test_the_router_waits_when_the_http_side_lags() -> None:
    """Its writes wait once STREAM_BUFFER messages are unread, as a gRPC stream's flow control would hold it."""

    async def behaviour(request, context, seen):
        for i in range(3 * STREAM_BUFFER):
            await context.write(chunk(str(i)))
            seen["written"] = i + 1

    async def main():
        servicer = Servicer(behaviour)
        turn = InProcessRouter(servicer).generate(pb.GenerateRequest())
        for _ in range(20):
            await asyncio.sleep(0)
        held = servicer.seen["written"]
        texts = [item.text async for item in turn.events()]
        return held, texts

    held, texts = run(main())
    assert held <= STREAM_BUFFER + 1
    assert texts == [str(i) for i in range(3 * STREAM_BUFFER)]

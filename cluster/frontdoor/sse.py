"""Server-sent events, as the OpenAI and Anthropic SDKs read them.

A stream that says nothing for a while (a turn queued behind busy cards, a long prompt's prefill) gets a
comment line every `keepalive_s` (the pool's `http_keepalive_s`): SSE readers, the SDKs' among them, skip
comments, and proxies that close idle connections (nginx and most load balancers after 60 s) see traffic."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from aiohttp import web

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE_KEY = web.AppKey("sse_keepalive_s", float)
KEEPALIVE = b": keep-alive\n\n"
_LAST_WRITE = web.ResponseKey("sse_last_write", float)
_PINGER = web.RequestKey("sse_pinger", asyncio.Task)


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Send the headers and keep the stream alive until `stop_keepalive(request)` (the app's middleware
    calls it when the handler returns)."""
    keepalive_s = request.app[KEEPALIVE_KEY]
    response = web.StreamResponse(status=200, headers=HEADERS)
    await response.prepare(request)
    response[_LAST_WRITE] = time.monotonic()
    request[_PINGER] = asyncio.create_task(_keep_alive(response, keepalive_s))
    return response


async def send(response: web.StreamResponse, data: dict[str, Any] | str, event: str | None = None) -> None:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    response[_LAST_WRITE] = time.monotonic()
    await response.write(f"{head}data: {text}\n\n".encode())


def stop_keepalive(request: web.Request) -> None:
    pinger = request.get(_PINGER)
    if pinger is not None:
        pinger.cancel()


async def _keep_alive(response: web.StreamResponse, keepalive_s: float) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):  # the client left, or the stream ended
        while True:
            idle_s = time.monotonic() - response[_LAST_WRITE]
            if idle_s < keepalive_s:
                await asyncio.sleep(keepalive_s - idle_s)
                continue
            response[_LAST_WRITE] = time.monotonic()
            await response.write(KEEPALIVE)

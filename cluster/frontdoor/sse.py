"""Server-sent events, as the OpenAI and Anthropic SDKs read them."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=HEADERS)
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, data: dict[str, Any] | str, event: str | None = None) -> None:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    await response.write(f"{head}data: {text}\n\n".encode())

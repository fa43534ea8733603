"""The HTTP server: routes, body limits, and every failure answered in its API's error shape.

`FrontDoor` runs in the pool's process, on its event loop, and calls the router's gRPC servicer there
(upstream.py), so that authentication, limits, session ownership and routing apply to HTTP callers exactly as
to gRPC ones."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.tokenizer import Tokenizer

from ..config import PoolConfig
from . import anthropic_api, openai_api, responses_api, sse
from .errors import ApiError
from .params import object_body, valid_unicode
from .service import Service
from .template import ChatTemplate
from .upstream import InProcessRouter

log = logging.getLogger(__name__)
Handler = Callable[[Service, web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


def _is_anthropic(request: web.Request) -> bool:
    return request.path.startswith("/v1/messages")


def error_response(request: web.Request, error: ApiError) -> web.Response:
    body = error.anthropic_body() if _is_anthropic(request) else error.openai_body()
    return web.json_response(body, status=error.status, headers=error.headers)


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(request, error)
    except web.HTTPRequestEntityTooLarge as error:
        return error_response(request, ApiError(413, f"request body too large: {error.text}", param="body"))
    except web.HTTPException as error:  # unknown path, wrong method
        if error.status < 400:
            raise
        message = f"{request.method} {request.path}: {error.reason}"
        return error_response(request, ApiError(error.status, message))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as error:  # a bug: logged here, named to the client, never a stack trace
        log.exception("%s %s failed", request.method, request.path)
        return error_response(request, ApiError(500, f"internal error ({type(error).__name__})"))
    finally:
        sse.stop_keepalive(request)


def _post(
    service: Service, handler: Handler, *, local: bool = False
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """`local`: the handler answers without a router call, so the router checks the caller's key first."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        if local:
            await service.model_info(request)
        raw = await request.read()
        try:
            body = object_body(json.loads(raw))
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"body: not valid JSON ({e})", param="body") from None
        valid_unicode(body, raw)
        return await handler(service, request, body)

    return wrapped


def _get(
    service: Service, handler: Callable[[Service, web.Request], Awaitable[web.StreamResponse]]
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        await service.model_info(request)  # answered here: the router checks the key
        return await handler(service, request)

    return wrapped


def make_app(service: Service, max_body_bytes: int, keepalive_s: float) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=max_body_bytes)
    app[sse.KEEPALIVE_KEY] = keepalive_s
    app.router.add_post("/v1/chat/completions", _post(service, openai_api.chat_completions))
    app.router.add_post("/v1/completions", _post(service, openai_api.completions))
    app.router.add_get("/v1/models", _get(service, openai_api.list_models))
    app.router.add_get("/v1/models/{model}", _get(service, openai_api.get_model))
    app.router.add_post("/v1/messages", _post(service, anthropic_api.messages))
    app.router.add_post("/v1/messages/count_tokens", _post(service, anthropic_api.count_tokens, local=True))
    app.router.add_post("/v1/responses", _post(service, responses_api.responses))
    return app


class FrontDoor:
    """The HTTP server of one pool: `start()` loads the tokenizer and listens; `stop()` closes."""

    def __init__(
        self,
        *,
        model: str,
        model_dir: str,
        router: Any,
        host: str,
        port: int,
        max_body_bytes: int,
        user_sessions: bool = False,
        prefix_sharing: str = "user",
        keepalive_s: float = PoolConfig.http_keepalive_s,
    ) -> None:
        self.model = model
        self.model_dir = model_dir
        self.router = InProcessRouter(router)
        self.host, self.port = host, port
        self.max_body_bytes = max_body_bytes
        self.user_sessions = user_sessions
        self.prefix_sharing = prefix_sharing
        self.keepalive_s = keepalive_s
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        tokenizer = await asyncio.to_thread(self._tokenizer)
        template = await asyncio.to_thread(ChatTemplate, tokenizer)
        service = Service(self.router, template, self.model, self.user_sessions, self.prefix_sharing)
        # handler_cancellation: a client that closes its connection cancels its handler, which cancels
        # the router's task for its turn, which frees the card at once.
        self._runner = web.AppRunner(
            make_app(service, self.max_body_bytes, self.keepalive_s),
            handler_cancellation=True,
            access_log=None,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        if self.port == 0 and server is not None and server.sockets:  # type: ignore[union-attr]
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def _tokenizer(self) -> Tokenizer:
        return open_checkpoint(self.model_dir).tokenizer()  # the same loader the cards use

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

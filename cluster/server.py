"""The pool's process: gRPC router (with health and reflection), card registry, metrics and discovery.

`PoolServer` runs on an asyncio loop in a process that is already connected to Ray (`onestream serve`
connects or starts one). `PoolThread` runs one on a background thread, for tests and embedding.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2
from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.tokenizer import Tokenizer

from . import wire
from .auth import Authenticator
from .card import SessionRecord
from .cards import CardRegistry
from .config import PoolConfig
from .discovery import service_discovery_groups
from .engine_source import source_for
from .frontdoor.app import FrontDoor
from .health import HealthServicer
from .http_server import MetricsHTTPServer
from .metrics import RouterMetrics
from .policy import Scheduler
from .router import Router

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["OneStream"].full_name


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def _routing_tokenizer(model_dir: str) -> Tokenizer | None:
    """The model's tokenizer, for routing text and chat prompts by prefix (None: token prompts only)."""
    try:
        return open_checkpoint(model_dir).tokenizer()  # the loader the cards use
    except Exception as e:  # routing degrades to placement; the cards report the real problem
        log.warning(
            "prefix routing of text prompts is off: cannot load the tokenizer of %s: %s", model_dir, e
        )
        return None


class PoolServer:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.grpc_port: int | None = None
        self.metrics_server: MetricsHTTPServer | None = None
        self.frontdoor: FrontDoor | None = None
        self.auth = Authenticator(config.api_keys_path)  # a bad key file fails here, before any start

    async def start(self, *, wait_for_cards: int = 1, ready_timeout_s: float | None = None) -> None:
        """Open the gRPC and metrics ports, start the cards, and wait until `wait_for_cards` serve."""
        self.model = source_for(self.config.model_dir, self.config.engine_source).label
        self.metrics = RouterMetrics(self.model, per_user=self.config.metrics_per_user)
        self._export_users()
        self.scheduler = Scheduler(
            queue_capacity=self.config.queue_capacity,
            home_wait_s=self.config.home_wait_s,
            session_ttl_s=self.config.session_ttl_s,
            user_max_queued=self.config.user_max_queued,
            retry_after_s=self.config.retry_after_s,
            on_change=self._update_gauges,
        )
        self.registry = CardRegistry(
            self.config,
            self.scheduler,
            self._update_gauges,
            on_card_up=self.metrics.add_card,
            on_sessions_adopted=self._adopt_owners,
        )
        self.router = Router(self.config, self.scheduler, self.registry, self.metrics, self.auth)
        self.router.tokenizer = await asyncio.to_thread(_routing_tokenizer, self.config.model_dir)

        metrics_host, metrics_port = split_address(self.config.metrics_address)
        self.metrics_server = MetricsHTTPServer(
            metrics_host, metrics_port, self.metrics.registry, {"/sd": self._service_discovery}
        )
        self.server = grpc.aio.server(options=wire.server_options())
        wire.add_servicer(self.router, self.server, pb.DESCRIPTOR.services_by_name["OneStream"])
        self.health = HealthServicer()
        wire.add_health_and_reflection(self.server, self.health, [SERVICE_NAME])
        self.grpc_port = self.server.add_insecure_port(self.config.grpc_address)
        if not self.grpc_port:
            raise OSError(f"cannot listen for gRPC on {self.config.grpc_address}")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)  # until a card serves
        await self.server.start()
        await self.registry.start()
        await self.registry.wait_until_ready(
            wait_for_cards,
            ready_timeout_s if ready_timeout_s is not None else self.config.card_start_timeout_s,
        )
        if self.config.http_address is not None:
            await self._start_frontdoor(self.config.http_address)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def _start_frontdoor(self, address: str) -> None:
        host, port = split_address(address)
        self.frontdoor = FrontDoor(
            model=self.model,
            model_dir=self.config.model_dir,
            router=self.router,
            host=host,
            port=port,
            max_body_bytes=self.config.http_max_body_bytes,
            user_sessions=self.config.http_user_sessions,
            prefix_sharing=self.config.prefix_sharing,
            keepalive_s=self.config.http_keepalive_s,
        )
        await self.frontdoor.start()

    @property
    def http_address(self) -> str | None:
        return self.frontdoor.endpoint if self.frontdoor is not None else None

    @property
    def grpc_address(self) -> str:
        host, _ = split_address(self.config.grpc_address)
        return f"{host}:{self.grpc_port}"

    @property
    def metrics_address(self) -> str:
        assert self.metrics_server is not None
        return self.metrics_server.endpoint

    async def drain(self) -> bool:
        """Stop admitting (health NOT_SERVING, new requests UNAVAILABLE) and wait for in-flight requests
        to finish, at most `drain_timeout_s`. True when everything finished."""
        self.router.draining = True
        await self.health.enter_graceful_shutdown()
        log.info("draining: %d requests in flight", self.router.in_flight)
        return await self.router.wait_idle(self.config.drain_timeout_s)

    async def stop(self) -> None:
        """Close the ports and stop watching the cards, which keep running for the next router to adopt
        (also after a start that did not finish)."""
        if self.frontdoor is not None:
            await self.frontdoor.stop()
            self.frontdoor = None
        if getattr(self, "server", None) is not None:
            await self.server.stop(self.config.stop_grace_s)
        if getattr(self, "registry", None) is not None:
            await self.registry.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    async def drain_and_stop(self) -> bool:
        """What SIGTERM does: drain, then stop. True when every in-flight request finished."""
        finished = await self.drain()
        if not finished:
            log.warning("drain timed out after %.0fs; stopping anyway", self.config.drain_timeout_s)
        await self.stop()
        return finished

    def reload_keys(self) -> bool:
        """What SIGHUP does: re-read the API key file (a bad file keeps the keys in force). Streams in
        flight are not touched; a removed key stops working at its next call."""
        reloaded = self.auth.reload()
        if reloaded and hasattr(self, "metrics"):
            self._export_users()
        return reloaded

    def _export_users(self) -> None:
        if self.metrics.per_user and self.auth.keys is not None:
            for user in sorted(self.auth.keys.users):
                self.metrics.add_user(user)

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _adopt_owners(self, sessions: list[SessionRecord]) -> None:
        """Sessions an adopted card caches stay their owners' (a restarted router starts with none)."""
        for session in sessions:
            if session.owner is not None:
                self.router.owners.adopt(session.session_id, session.owner, session.last_used)

    def _service_discovery(self) -> list[dict[str, Any]]:
        return service_discovery_groups(self.metrics_address, self.registry.sd_targets())

    def _update_gauges(self) -> None:
        if not hasattr(self, "registry"):
            return
        self.metrics.queue_depth.set(len(self.scheduler.queue))
        self.metrics.sessions.set(len(self.scheduler.bindings()))
        self.metrics.set_cards(self.registry.state_counts())


class PoolThread:
    """A PoolServer on its own event loop thread; `run(coro)` runs a coroutine on that loop."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pool-server", daemon=True)
        self._thread.start()
        self.pool = PoolServer(config)

    def start(self, *, wait_for_cards: int = 1, ready_timeout_s: float | None = None) -> PoolThread:
        self.run(self.pool.start(wait_for_cards=wait_for_cards, ready_timeout_s=ready_timeout_s))
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self.submit(coro).result(timeout_s)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a plain function on the loop (to read loop-owned state safely)."""

        async def wrapped() -> Any:
            return fn(*args)

        return self.run(wrapped())

    @property
    def grpc_address(self) -> str:
        return self.pool.grpc_address

    @property
    def metrics_address(self) -> str:
        return self.pool.metrics_address

    @property
    def http_address(self) -> str | None:
        return self.pool.http_address

    def stop(self) -> None:
        try:
            self.run(self.pool.stop(), timeout_s=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

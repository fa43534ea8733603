"""The card: a Ray actor owning one engine on one GPU (or one CPU engine), serving one stream at a time.

The actor is asynchronous: engine work runs on one dedicated thread (so the engine is never entered
twice at once), while the actor's event loop keeps answering pings, listings and cancellations during a
generation. Generations do not travel through Ray: the router streams them over the card's link
(cluster/card_link.py), served from the same event loop; a cancelled call stops the engine at the next
token boundary.

Each card serves its own Prometheus /metrics on its node (a free port), labelled with its identity.
The router (`cards.py`) creates these actors with `ray.remote(CardActor).options(...)`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import platform
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from typing import Any

from onestream.worker.api import Finished, GenerateRequest, TokenChunk
from onestream.worker.errors import OnestreamError

from .card_link import LinkServer, new_token
from .engine_source import EngineSource, source_for
from .http_server import MetricsHTTPServer
from .metrics import CardMetrics
from .prefix_index import PointReporter

log = logging.getLogger(__name__)

# A node offers CPU cards by advertising this custom resource (one unit per card), the way GPU nodes
# offer cards through `GPU`.
CPU_CARD_RESOURCE = "onestream_cpu_card"
NODE_ID_CHARS = 12  # the short node id used in card ids and the `node` label


@dataclass(frozen=True)
class CardSettings:
    """How to build a card's engine; the same for every card of a pool."""

    model_dir: str
    cpu: bool = False  # a CPU card: reference back end on the CPU
    slot: int = 0  # the card's index among the node's CPU cards (CPU cards only)
    backend: str = "auto"
    dtype: str | None = None
    torch_threads: int | None = None  # CPU cards: intra-op threads of the engine
    metrics_host: str | None = None  # None: the node's IP address
    engine_options: dict[str, Any] = field(default_factory=dict)
    # What builds the engine (cluster/engine_source.py); None: the checkpoint at `model_dir`.
    engine_source: EngineSource | None = None

    @property
    def source(self) -> EngineSource:
        return source_for(self.model_dir, self.engine_source)


@dataclass(frozen=True)
class CardIdentity:
    """Who a card is. `incarnation` changes every time the actor (re)starts: a changed incarnation means
    the card lost its cache."""

    node_id: str
    node_ip: str
    gpu_index: int
    gpu_uuid: str
    device_name: str
    backend: str
    model: str
    metrics_endpoint: str
    incarnation: str
    pid: int
    link_endpoint: str = ""  # where the card streams generations (host:port); set once it answers `ready`
    link_token: str = field(default="", repr=False)  # what the link asks of its caller (Ray carries it)

    @property
    def node_short(self) -> str:
        return self.node_id[:NODE_ID_CHARS]

    @property
    def card_id(self) -> str:
        return f"{self.node_short}/{self.gpu_index}/{self.gpu_uuid}"


@dataclass(frozen=True)
class CardLiveness:
    """A ping's answer: who answers (`incarnation`), whether a generation runs and the engine's progress
    counter (cluster/cards.py declares a busy card whose counter stops moving hung)."""

    incarnation: str
    busy: bool
    progress: int


@dataclass(frozen=True)
class CardError:
    """An error the engine raised for a request, sent to the router as a stream item. `kind` is the
    error's class name (worker/errors.py), which the router maps to a status code."""

    kind: str
    message: str


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    cached_tokens: int
    cached_bytes: int
    last_used: float = 0.0  # unix seconds (a router that adopts the card binds the newest copy)
    owner: str | None = None  # the user whose turns built it (a router that adopts the card keeps it theirs)


class _EndOfStream:
    pass


_END = _EndOfStream()


class CardActor:
    """One engine behind a Ray actor. Create with `ray.remote(CardActor).options(...).remote(settings)`."""

    def __init__(self, settings: CardSettings, load_board: Any = None) -> None:
        """`load_board`: the registry's LoadBoard, told how far the engine's weights have loaded."""
        if settings.torch_threads:
            import torch

            torch.set_num_threads(settings.torch_threads)
        reporter = _load_reporter(load_board, f"{_node()[0]}/{settings.slot}")
        self._engine = _build_engine(settings, reporter)
        try:  # compile the megakernel's builds before the card says it is ready, not in the first request
            self._engine.warm_up(reporter)
        except Exception as e:  # the first request then compiles (or reports) whatever failed here
            log.warning("card warm-up failed: %s: %s", type(e).__name__, e)
        self._model_info = settings.source.model_info(self._engine)
        model = str(self._model_info.get("model_name") or settings.source.label)
        gpu_index, gpu_uuid, device_name = _device_identity(settings)
        node_id, node_ip = _node()
        self._metrics = CardMetrics(
            node=node_id[:NODE_ID_CHARS],
            gpu_index=gpu_index,
            gpu_uuid=gpu_uuid,
            model=model,
            backend=str(self._model_info.get("backend", settings.backend)),
            device_name=device_name,
            spec_k=int(self._model_info.get("max_drafts", self._model_info.get("spec_k")) or 0),
            model_format=str(self._model_info.get("format", "")),
            kv_cache=str(self._model_info.get("kv_cache", "auto")),
        )
        self._http = MetricsHTTPServer(settings.metrics_host or node_ip, 0, self._metrics.registry)
        self.identity = CardIdentity(
            node_id=node_id,
            node_ip=node_ip,
            gpu_index=gpu_index,
            gpu_uuid=gpu_uuid,
            device_name=device_name,
            backend=str(self._model_info.get("backend", settings.backend)),
            model=model,
            metrics_endpoint=self._http.endpoint,
            incarnation=uuid.uuid4().hex,
            pid=os.getpid(),
        )
        self.settings = settings
        self._stops: set[threading.Event] = set()  # one per generation in flight or queued
        # One thread runs every engine call, so the engine never runs two things at once.
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._sessions: list[SessionRecord] = []
        # Session id -> the user of its turns, for the sessions the engine caches: a restarted router
        # learns from the cards who owns what. Read and written on the engine thread only.
        self._owners: dict[str, str] = {}
        self._prefix_reporter = PointReporter()
        self._busy = False
        self._link: LinkServer | None = None  # started by the first `ready`, in the actor's event loop
        self._link_started: asyncio.Future[None] | None = None
        self._refresh_sessions()
        # What the card holds from now on (the model, Ray, gRPC) lives as long as it: out of the collector's
        # way, so that a full collection in a generation does not walk it all (about 0.2 s on a CPU card).
        gc.collect()
        gc.freeze()

    # ---- queries (answered at once, even while generating) -------------------------------------------
    async def ready(self) -> CardIdentity:
        """The card's identity, with the endpoint of its link (started by the first call)."""
        if self._link_started is None:
            self._link = LinkServer(self.identity.node_ip, new_token(), self._items)
            self.identity = replace(
                self.identity, link_endpoint=self._link.endpoint, link_token=self._link.token
            )
            self._link_started = asyncio.ensure_future(self._link.start())
        await asyncio.shield(self._link_started)
        return self.identity

    async def ping(self) -> CardLiveness:
        return CardLiveness(self.identity.incarnation, self._busy, self._engine.progress)

    async def card_settings(self) -> CardSettings:
        return self.settings

    async def stop_generations(self) -> int:
        """Stop every generation in flight or queued (their caller is gone: a router that adopts this
        card calls it) and return once they ended, their sessions cached. Returns how many there were."""
        for stop in self._stops:
            stop.set()
        count = len(self._stops)
        loop = asyncio.get_running_loop()
        # The engine thread runs its work in order: this runs after the stopped generations.
        await loop.run_in_executor(self._engine_thread, self._refresh_sessions)
        return count

    async def model_info(self) -> dict[str, Any]:
        return dict(self._model_info)

    async def sessions(self) -> list[SessionRecord]:
        return list(self._sessions)

    async def status(self) -> dict[str, Any]:
        return {
            "busy": self._busy,
            "cached_sessions": len(self._sessions),
            "cached_session_bytes": sum(s.cached_bytes for s in self._sessions),
            "rss_bytes": _resident_bytes(),
        }

    # ---- engine work -----------------------------------------------------------------------------
    async def close_session(self, session_id: str) -> CardError | None:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._engine_thread, self._close_session, session_id)

    async def _items(self, request: GenerateRequest) -> AsyncIterator[TokenChunk | Finished | CardError]:
        """The engine's chunks and final `Finished` (or one `CardError`) for `request`: what the link sends."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[object] = asyncio.Queue()
        stop = threading.Event()

        def put(item: object) -> None:
            loop.call_soon_threadsafe(items.put_nowait, item)

        self._stops.add(stop)
        self._engine_thread.submit(self._run_generation, request, put, stop)
        held: object | None = None  # an item taken while coalescing, sent next
        try:
            while True:
                if held is None:
                    item = await items.get()
                else:
                    item, held = held, None
                if item is _END:
                    return
                if isinstance(item, TokenChunk):
                    item, held = _coalesce(item, items)
                yield item  # type: ignore[misc]
        finally:
            stop.set()  # the caller cancelled or went away: end at the next token boundary
            self._stops.discard(stop)

    # ---- on the engine thread ----------------------------------------------------------------------
    def _run_generation(self, request: GenerateRequest, put: Any, stop: threading.Event) -> None:
        import torch

        if stop.is_set():  # cancelled while queued behind other engine work: do not start it
            self._metrics.requests("cancelled").inc()
            put(_END)
            return
        self._busy = True
        self._metrics.busy.set(1)
        if request.session_id and request.user:
            self._owners[request.session_id] = request.user
        finished = False
        try:
            # Serving never needs autograd; inference mode is thread-local, so it is entered here.
            with torch.inference_mode():
                finished = self._stream_engine(request, put, stop)
        except OnestreamError as e:
            put(CardError(type(e).__name__, str(e)))
        except Exception as e:  # a bug: the router answers INTERNAL naming it
            log.exception("card %s: generation failed", self.identity.card_id)
            put(CardError("InternalError", f"{type(e).__name__}: {e}"))
        finally:
            if not finished and stop.is_set():
                self._metrics.requests("cancelled").inc()
            self._refresh_sessions()
            self._busy = False
            self._metrics.busy.set(0)
            put(_END)

    def _stream_engine(self, request: GenerateRequest, put: Any, stop: threading.Event) -> bool:
        """Forward the engine's items until it finishes (True) or the caller stops it (False)."""
        stream: Iterator[TokenChunk | Finished] = self._engine.generate(request)
        try:
            for item in stream:
                if isinstance(item, TokenChunk):
                    self._metrics.generation_tokens.inc(len(item.token_ids))
                elif isinstance(item, Finished):
                    stream.close()  # the engine caches the turn's state now: the report below includes it
                    self._observe_finished(item)
                    # The sessions as listed include this turn before its finish leaves: a client that lists
                    # them on the finish, which the link brings it at once, must find the turn there.
                    self._refresh_sessions()
                    put(self._prefix_reporter.report(self._engine.prefix_points()))
                    put(item)
                    return True
                put(item)
                if stop.is_set():
                    return False
            return False
        finally:
            stream.close()  # when stopped: cancels the engine's loop at the token boundary

    def _observe_finished(self, item: Finished) -> None:
        self._metrics.observe_finished(item)
        reuse = self._engine.last_reuse
        self._metrics.observe_prefix_hit(reuse.tokens if reuse.by_prefix else 0)

    def _close_session(self, session_id: str) -> CardError | None:
        try:
            self._engine.close_session(session_id)
        except OnestreamError as e:
            return CardError(type(e).__name__, str(e))
        finally:
            self._refresh_sessions()
        return None

    def _refresh_sessions(self) -> None:
        records = [_session_record(s) for s in self._engine.sessions()]
        self._owners = {
            r.session_id: self._owners[r.session_id] for r in records if r.session_id in self._owners
        }
        self._sessions = [replace(r, owner=self._owners.get(r.session_id)) for r in records]
        self._metrics.set_sessions(len(self._sessions), sum(s.cached_bytes for s in self._sessions))
        self._metrics.set_prefix_checkpoints(*self._engine.shared_prefixes())
        self._metrics.set_draft_vocab(self._engine.backend.draft_vocab or self._engine.config.vocab_size)


def _coalesce(chunk: TokenChunk, items: asyncio.Queue[object]) -> tuple[TokenChunk, object | None]:
    """`chunk` merged with the chunks queued behind it, and the first other item taken (or None). An engine
    faster than the link then costs one stream item per wake-up of this loop, not one per token; when
    the stream keeps up nothing is queued and every chunk goes alone, as soon as it is made."""
    queued: list[TokenChunk] = []
    held: object | None = None
    while held is None and not items.empty():
        item = items.get_nowait()
        if isinstance(item, TokenChunk):
            queued.append(item)
        else:
            held = item
    if not queued:
        return chunk, held
    parts = [chunk, *queued]
    return TokenChunk([t for c in parts for t in c.token_ids], "".join(c.text for c in parts)), held


def _load_reporter(board: Any, key: str) -> Callable[[Any], None] | None:
    """Posts the fraction of the current stage (the weights' load, then the kernels' compilation) to the
    LoadBoard at every whole percent (a remote call per tensor would be thousands for a large model)."""
    if board is None:
        return None
    posted = ["", -1.0]

    def report(progress: Any) -> None:
        if progress.stage != posted[0]:  # a new stage starts from its own zero
            posted[:] = [progress.stage, -1.0]
        if progress.fraction - posted[1] >= 0.01 or progress.fraction >= 1.0:
            posted[1] = progress.fraction
            board.report.remote(key, progress.fraction)

    return report


def _build_engine(settings: CardSettings, on_load_progress: Callable[[Any], None] | None = None) -> Any:
    """The card's engine, from its settings' source: only the device and back end are the card's to decide."""
    backend = "reference" if settings.cpu and settings.backend == "auto" else settings.backend
    return settings.source.build(
        device="cpu" if settings.cpu else "cuda",
        backend=backend,
        dtype=settings.dtype,
        options=dict(settings.engine_options),
        on_load_progress=on_load_progress,
    )


def _node() -> tuple[str, str]:
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def _device_identity(settings: CardSettings) -> tuple[int, str, str]:
    """(gpu index on its node, GPU UUID as DCGM spells it, device name); `cpu-N` for CPU cards."""
    if settings.cpu:
        return settings.slot, f"cpu-{settings.slot}", platform.processor() or platform.machine() or "cpu"
    import ray
    import torch

    gpu_ids = ray.get_gpu_ids()
    index = int(gpu_ids[0]) if gpu_ids else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(0)  # Ray sets CUDA_VISIBLE_DEVICES to this card alone
    raw_uuid = str(getattr(props, "uuid", "") or "")
    gpu_uuid = raw_uuid if raw_uuid.startswith("GPU-") else f"GPU-{raw_uuid}" if raw_uuid else f"gpu-{index}"
    return index, gpu_uuid, props.name


def _resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _plain(value: Any) -> Any:
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else value


def _session_record(session: Any) -> SessionRecord:
    """The engine's description of a cached session, whatever its shape (dataclass, dict or id)."""
    fields = _plain(session)
    if not isinstance(fields, dict):
        return SessionRecord(str(fields), 0, 0)
    return SessionRecord(
        session_id=str(fields.get("session_id", fields.get("id", ""))),
        cached_tokens=int(fields.get("tokens", fields.get("cached_tokens", fields.get("length", 0))) or 0),
        cached_bytes=int(fields.get("nbytes", fields.get("bytes", fields.get("cached_bytes", 0))) or 0),
        last_used=float(fields.get("last_used", 0.0) or 0.0),
    )

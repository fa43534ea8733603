"""The gRPC service (onestream.v1.OneStream): admission, queueing, streaming from cards, errors.

Each Generate call: validate -> wait for a card (cluster/policy.py; queue positions streamed) -> stream
from the card over its link (cluster/card_link.py) -> release the card and bind the session to it. Every
failure ends the call with one status code and a message naming the problem (see the .proto's header).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import timezone
from typing import Any, TypeVar

import grpc
from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.protos.onestream.v1 import onestream_pb2_grpc as pb_grpc
from onestream.worker.api import Finished, GenerateRequest, TokenChunk
from onestream.worker.errors import InvalidRequestError, OnestreamError
from onestream.worker.prefixes import sharing_scope
from onestream.worker.tokenizer import Tokenizer
from ray.exceptions import RayError, RayTaskError

from . import convert, limits
from .auth import RETRY_AFTER, Authenticator, AuthError, Caller, SessionOwners
from .card import CardError, SessionRecord
from .card_link import LinkCall, LinkFailed, LinkLost
from .cards import CardRecord, CardRegistry
from .config import PoolConfig
from .errors import (
    DEADLINE,
    DRAINING,
    INVALID_ARGUMENT,
    NO_CARDS,
    PERMISSION_DENIED,
    UNAUTHENTICATED,
    USER_CONCURRENT,
    CardFailure,
    PoolError,
    code_for_engine_error,
)
from .metrics import RouterMetrics
from .policy import CardPhase, Scheduler
from .prefix_index import PrefixReport
from .queue import Assignment, Waiter
from .wire import client_error

log = logging.getLogger(__name__)
T = TypeVar("T")
LIVENESS_POLL_S = 0.2  # how often a waiting stream looks at its card's liveness

_CARD_STATES = {
    CardPhase.FREE: pb.CARD_STATE_FREE,
    CardPhase.BUSY: pb.CARD_STATE_BUSY,
    CardPhase.DOWN: pb.CARD_STATE_DOWN,
}


@dataclass
class _InFlight:
    request_id: str
    task: asyncio.Task[Any]
    user: str | None
    session_id: str | None = None
    aborted: bool = False
    session_closed: bool = False  # CloseSession came during this turn: it must not bind the session again


class Router(pb_grpc.OneStreamServicer):
    def __init__(
        self,
        config: PoolConfig,
        scheduler: Scheduler,
        registry: CardRegistry,
        metrics: RouterMetrics,
        auth: Authenticator,
    ) -> None:
        sharing_scope(None, config.prefix_sharing)  # a bad mode fails here, not in every request
        self.config = config
        self.scheduler = scheduler
        self.registry = registry
        self.metrics = metrics
        self.auth = auth
        # Outlives the session's binding, whose TTL counts from the end of its last turn, not the start.
        self.owners = SessionOwners(2 * config.session_ttl_s)
        self.draining = False
        self._inflight: dict[str, _InFlight] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Future[Any]] = set()  # fire-and-forget card calls, kept alive
        # Tokenizes text and chat prompts for prefix routing (cluster/server.py loads it; None: token
        # prompts only).
        self.tokenizer: Tokenizer | None = None

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight (queued or generating); False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    # ---- Generate -------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        arrived = time.monotonic()
        caller: Caller | None = None
        try:
            caller = self._authenticated(context)
            self.metrics.user_request(caller.user)
            limits.check_generate(request, (self.registry.model_info or {}).get("max_context"))
            self._admit(caller, request.session_id)
        except InvalidRequestError as e:
            error = PoolError(grpc.StatusCode.INVALID_ARGUMENT, str(e), INVALID_ARGUMENT)
            await self._refuse("Generate", error, context, caller)
        except PoolError as e:
            await self._refuse("Generate", e, context, caller)
        assert caller is not None
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self._inflight:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight"
            )
        task = asyncio.current_task()
        assert task is not None
        entry = _InFlight(request_id, task, caller.user, session_id=request.session_id or None)
        self._inflight[request_id] = entry
        self._idle.clear()
        error: PoolError | None = None
        try:
            await self._generate(request, entry, arrived, context)
        except PoolError as e:
            error = e
        except asyncio.CancelledError:
            if not entry.aborted:
                raise  # the client went away
            if hasattr(task, "uncancel"):  # Python 3.11+: the cancellation is handled here
                task.uncancel()
            error = PoolError(grpc.StatusCode.CANCELLED, f"request {request_id} was aborted (Abort)")
        finally:
            del self._inflight[request_id]
            if not self._inflight:
                self._idle.set()
        if error is not None:
            await self._refuse("Generate", error, context, caller)

    async def _refuse(
        self, rpc: str, error: PoolError, context: grpc.aio.ServicerContext, caller: Caller | None = None
    ) -> None:
        """End the call with `error` (counted as a rejection, for the caller's user too, when it has a
        reason), with its retry hint as trailing metadata."""
        if error.reason is not None:
            self.metrics.rejected(error.reason)
            if caller is not None:
                self.metrics.user_rejected(caller.user, error.reason)
        if error.code == grpc.StatusCode.INVALID_ARGUMENT:
            client_error(rpc, error.code, error.message)
        hint = () if error.retry_after_s is None else ((RETRY_AFTER, str(error.retry_after_s)),)
        await context.abort(error.code, error.message, trailing_metadata=hint)

    def _authenticated(self, context: grpc.aio.ServicerContext) -> Caller:
        try:
            return self.auth.caller(context.invocation_metadata())
        except AuthError as e:
            raise PoolError(grpc.StatusCode.UNAUTHENTICATED, str(e), UNAUTHENTICATED) from None

    def _admit(self, caller: Caller, session_id: str) -> None:
        """The caller's right to this turn: its own session, and room under its concurrency limit."""
        if session_id:
            self._check_owner_known(session_id)
            owner = self.owners.claim(session_id, caller)
            if owner is not None:
                raise PoolError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"session {session_id!r} belongs to another user; use a session id of your own",
                    PERMISSION_DENIED,
                )
        limit = self.config.user_max_concurrent
        if limit is not None and caller.user is not None:
            running = sum(e.user == caller.user for e in self._inflight.values())
            if running >= limit:
                raise PoolError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"user {caller.user} already has {running} requests in flight, the most a user may "
                    f"have (--user-max-concurrent {limit}); retry in {self.config.retry_after_s}s",
                    USER_CONCURRENT,
                    retry_after_s=self.config.retry_after_s,
                )

    def _check_owner_known(self, session_id: str) -> None:
        """A router that just started over running cards learns their sessions' owners as it adopts them:
        until then it neither gives a session to a caller nor closes it."""
        if self.auth.enabled and self.owners.owner_of(session_id) is None and self.registry.adopting():
            raise PoolError(
                grpc.StatusCode.UNAVAILABLE,
                "the router is starting: it is adopting the running cards and does not know their "
                f"sessions' owners yet; retry in {self.config.retry_after_s}s",
                NO_CARDS,
                retry_after_s=self.config.retry_after_s,
            )

    async def _generate(
        self, request: pb.GenerateRequest, entry: _InFlight, arrived: float, context: grpc.aio.ServicerContext
    ) -> None:
        request_id = entry.request_id
        if self.draining:
            raise PoolError(
                grpc.StatusCode.UNAVAILABLE, "the server is draining: it admits no new requests", DRAINING
            )
        engine_request = self._validated(request, request_id)
        engine_request.user = entry.user
        deadline = self._deadline(request, context, arrived)
        queue_deadline = min(deadline, arrived + self.config.queue_timeout_s)
        previous: Waiter | None = None
        prefix = self._prefix_matches(engine_request)
        for attempt in range(self.config.retries_before_first_token + 1):
            waiter = self.scheduler.submit(
                request_id, engine_request.session_id, user=entry.user, retry_of=previous, prefix=prefix
            )
            previous = waiter
            assignment = await self._wait_for_card(waiter, queue_deadline, deadline, entry, context)
            if attempt == 0:
                self.metrics.observe_queue_time(assignment.card_id, assignment.queue_wait_s)
            self.metrics.affinity(assignment.affinity)
            self.metrics.prefix_routing(assignment.prefix)
            try:
                await self._stream(engine_request, assignment, arrived, deadline, entry, context)
                return
            except CardFailure as failure:
                if attempt < self.config.retries_before_first_token:
                    log.warning(
                        "%s before the first token; retrying request %s elsewhere", failure, request_id
                    )
                    continue
                raise PoolError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{failure} before the first token, and so did the retry; try again later",
                ) from failure

    def _prefix_matches(self, request: GenerateRequest) -> dict[str, int]:
        """Card id -> tokens of the request's prompt prefix the card holds (cluster/prefix_index.py)."""
        index = self.scheduler.prefixes
        if not index.cards() or (
            request.session_id is not None and self.scheduler.home_of(request.session_id)
        ):
            return {}
        tokens = self._prompt_tokens(request)
        if not tokens:
            return {}
        return index.matches(sharing_scope(request.user, self.config.prefix_sharing), tokens)

    def _prompt_tokens(self, request: GenerateRequest) -> list[int] | None:
        """The prompt's token ids as the cards will see them: text and chat prompts are tokenized here
        (the `tokenizers` library is fast; a 20K-token prompt takes milliseconds)."""
        prompt = request.prompt
        if isinstance(prompt, list) and not request.is_chat:
            return prompt  # type: ignore[return-value]
        if self.tokenizer is None:
            return None
        limit = int((self.registry.model_info or {}).get("max_context") or 1 << 20)
        try:
            text = (
                prompt
                if isinstance(prompt, str)
                else self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)  # type: ignore[arg-type]
            )
            scope = sharing_scope(request.user, self.config.prefix_sharing)
            return self.tokenizer.encode_at_most(text, limit, memo_scope=scope)
        except OnestreamError:
            return None  # the card answers with the error

    def _validated(self, request: pb.GenerateRequest, request_id: str) -> GenerateRequest:
        info = self.registry.model_info or {}
        max_context = info.get("max_context")
        try:
            engine_request = convert.request_from_proto(request, request_id, info.get("generation_defaults"))
            engine_request.validate(vocab_size=info.get("vocab_size"), max_context=max_context)
            if max_context and isinstance(engine_request.prompt, list) and not engine_request.is_chat:
                engine_request.check_context(len(engine_request.prompt), int(max_context))
        except InvalidRequestError as e:
            raise PoolError(grpc.StatusCode.INVALID_ARGUMENT, str(e), INVALID_ARGUMENT) from e
        return engine_request

    def _deadline(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, arrived: float
    ) -> float:
        """The request's deadline on the monotonic clock (inf when none)."""
        deadline = float("inf")
        if request.HasField("deadline"):
            remaining = request.deadline.ToNanoseconds() / 1e9 - time.time()
            if remaining <= 0:
                when = request.deadline.ToDatetime(tzinfo=timezone.utc).isoformat()
                raise PoolError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"deadline {when} already passed {-remaining:.3f}s before the request arrived",
                    DEADLINE,
                )
            deadline = arrived + remaining
        grpc_remaining = context.time_remaining()
        if grpc_remaining is not None:
            deadline = min(deadline, arrived + grpc_remaining)
        return deadline

    async def _wait_for_card(
        self,
        waiter: Waiter,
        queue_deadline: float,
        deadline: float,
        entry: _InFlight,
        context: grpc.aio.ServicerContext,
    ) -> Assignment:
        try:
            while waiter.assignment is None:
                _raise_if_stopped(entry, context)
                remaining = queue_deadline - time.monotonic()
                if remaining <= 0:
                    waited = time.monotonic() - waiter.arrived
                    what = "its deadline" if queue_deadline >= deadline else "the queue timeout"
                    raise PoolError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no card became free within {what}: waited {waited:.1f}s at queue position {waiter.position}",
                        DEADLINE,
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    update = await asyncio.wait_for(waiter.updates.get(), remaining)
                    if isinstance(update, int) and waiter.assignment is None:
                        await context.write(
                            pb.GenerateResponse(
                                request_id=entry.request_id,
                                queued=pb.QueuePosition(
                                    position=update, queue_depth=len(self.scheduler.queue)
                                ),
                            )
                        )
            return waiter.assignment
        except BaseException:
            self.scheduler.withdraw(waiter)  # frees a card it was given but will not use
            raise

    async def _stream(
        self,
        request: GenerateRequest,
        assignment: Assignment,
        arrived: float,
        deadline: float,
        entry: _InFlight,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Run the request on its card and stream the results; always gives the card back."""
        card_id = assignment.card_id
        session_id = request.session_id
        bind = False
        call: LinkCall | None = None
        sent_tokens = 0
        try:
            actor = self.registry.actor(card_id)
            link = self.registry.link(card_id)
        except KeyError:
            self.scheduler.release(card_id, None)
            raise CardFailure(card_id, "left the pool") from None
        card = convert.card_to_proto(
            self.registry.identity(card_id), card_id=card_id, state=pb.CARD_STATE_BUSY
        )
        try:
            call = link.generate(request)  # the card starts while the client hears where it runs
            await context.write(
                pb.GenerateResponse(
                    request_id=request.request_id,
                    assigned=pb.Assigned(card=card, affinity_hit=assignment.affinity == "hit"),
                )
            )
            first_token_at: float | None = None
            while True:
                item = await self._next_item(call, card_id, sent_tokens, deadline)
                _raise_if_stopped(entry, context)
                if isinstance(item, PrefixReport):
                    self.scheduler.prefixes.update(card_id, item.points)
                    continue
                if isinstance(item, CardError):
                    code = code_for_engine_error(item.kind)
                    reason = INVALID_ARGUMENT if code == grpc.StatusCode.INVALID_ARGUMENT else None
                    raise PoolError(code, item.message, reason)
                if isinstance(item, TokenChunk):
                    if first_token_at is None:
                        first_token_at = time.monotonic()
                    sent_tokens += len(item.token_ids)
                    self.metrics.user_tokens(request.user, generated=len(item.token_ids))
                    bind = True  # the card now holds this session's prompt
                    await context.write(
                        pb.GenerateResponse(request_id=request.request_id, chunk=convert.chunk_to_proto(item))
                    )
                elif isinstance(item, Finished):
                    bind = True
                    self.metrics.user_tokens(request.user, prompt=item.usage.prompt_tokens)
                    now = time.monotonic()
                    finished = convert.finished_to_proto(
                        item,
                        card,
                        queue_wait_s=assignment.queue_wait_s,
                        time_to_first_token_s=(first_token_at or now) - arrived,
                        total_s=now - arrived,
                    )
                    await context.write(pb.GenerateResponse(request_id=request.request_id, finished=finished))
                    call.end()  # the card's link keeps the connection for its next call
                    return
                else:
                    raise PoolError(
                        grpc.StatusCode.INTERNAL, f"card {card_id} sent an unexpected {type(item).__name__}"
                    )
        except CardFailure as failure:
            if sent_tokens:
                raise PoolError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{failure} after streaming {sent_tokens} tokens; send the turn again "
                    "(the session re-prefills on another card)",
                ) from failure
            raise
        finally:
            if call is not None:
                call.cancel()  # no-op when it already ended
            previous_home = self.scheduler.home_of(session_id) if session_id else None
            self.scheduler.release(card_id, session_id, bind=bind and not entry.session_closed)
            if bind and entry.session_closed:  # closed during this turn: drop what the turn cached
                self._in_background(actor.close_session.remote(session_id))
            elif previous_home not in (None, card_id) and self.scheduler.home_of(session_id) == card_id:
                self._close_copy(previous_home, session_id)  # it moved: the old home's copy is stale

    async def _next_item(self, call: LinkCall, card_id: str, sent_tokens: int, deadline: float) -> object:
        """The next stream item, or CardFailure (dead, down, silent too long) / PoolError (deadline).

        While it waits it watches the card's liveness (cluster/cards.py): a stream on a card that went
        down ends within LIVENESS_POLL_S. The silence limits are a backstop for a stream that stalls while
        its card still progresses."""
        limit = self.config.token_timeout_s if sent_tokens else self.config.first_token_timeout_s
        identity = self.registry.identity(card_id)
        remaining = deadline - time.monotonic()
        give_up = time.monotonic() + min(limit, max(remaining, 0.0))
        pending = asyncio.ensure_future(_next_object(call))
        try:
            while not pending.done():
                failure = self.registry.failure(card_id)
                if failure is not None:
                    raise CardFailure(card_id, failure)
                left = give_up - time.monotonic()
                if left <= 0:
                    break
                await asyncio.wait({pending}, timeout=min(left, LIVENESS_POLL_S))
            if not pending.done():
                if remaining <= limit:
                    raise PoolError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"deadline passed while generating on card {card_id} ({sent_tokens} tokens sent)",
                        DEADLINE,
                    )
                what = f"sent nothing for {limit:.0f}s (hung)"
                self.registry.report_failure(card_id, what, hung=True, seen=identity)
                raise CardFailure(card_id, what)
            return pending.result()
        except StopAsyncIteration:
            raise PoolError(
                grpc.StatusCode.INTERNAL, f"card {card_id} ended the stream without a final message"
            ) from None
        except LinkFailed as e:  # the card's end of the link failed: a bug on the card
            raise PoolError(grpc.StatusCode.INTERNAL, f"card {card_id} failed: {_first_line(e)}") from e
        except LinkLost as e:  # the card's process died, or its node
            known = self.registry.failure(card_id)  # the registry took it down (and killed it) first
            if known is not None:
                raise CardFailure(card_id, known) from e
            self.registry.report_failure(card_id, "died mid-stream", hung=False, seen=identity)
            raise CardFailure(card_id, f"died mid-stream ({e})") from e
        finally:
            if not pending.done():
                pending.cancel()

    # ---- Abort, sessions ------------------------------------------------------------------------
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        caller = await self._caller(context)
        try:
            limits.check_abort(request)
        except InvalidRequestError as e:
            await self._refuse("Abort", PoolError(grpc.StatusCode.INVALID_ARGUMENT, str(e)), context)
        for request_id in request.request_ids:
            entry = self._inflight.get(request_id)
            if entry is not None and not caller.may_act_for(entry.user):
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"request {request_id!r} belongs to another user; nothing was aborted",
                )
        aborted = []
        for request_id in request.request_ids:
            entry = self._inflight.get(request_id)
            if entry is not None and not entry.aborted:
                entry.aborted = True
                entry.task.cancel()
                aborted.append(request_id)
        return pb.AbortResponse(aborted=aborted)

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:
        caller = await self._caller(context)
        session_id = request.session_id
        try:
            limits.check_id("session_id", session_id, required=True)
        except InvalidRequestError as e:
            await self._refuse("CloseSession", PoolError(grpc.StatusCode.INVALID_ARGUMENT, str(e)), context)
        try:
            self._check_owner_known(session_id)
        except PoolError as e:
            await self._refuse("CloseSession", e, context)
        owner = self.owners.owner_of(session_id)
        if owner is not None and not caller.may_act_for(owner):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"session {session_id!r} belongs to another user"
            )
        self.owners.forget(session_id)
        card_id = self.scheduler.home_of(session_id)
        turns = [e for e in self._inflight.values() if e.session_id == session_id and not e.session_closed]
        if card_id is None and not turns:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown session {session_id!r}: no card holds it"
            )
        for entry in turns:  # they finish, then drop the state they cached instead of binding it
            entry.session_closed = True
        self.scheduler.forget_session(session_id)
        if card_id is None:  # only its first turn is in flight, and drops its state when it ends
            return pb.CloseSessionResponse()
        # The card finishes its current generation first (one engine call at a time).
        result = await self._call(
            self.registry.actor(card_id).close_session.remote(session_id),
            self.config.first_token_timeout_s,
            card_id,
            context,
        )
        if isinstance(result, CardError):
            await context.abort(code_for_engine_error(result.kind), f"card {card_id}: {result.message}")
        self._close_elsewhere(session_id, card_id)
        return pb.CloseSessionResponse(card_id=card_id)

    def _close_elsewhere(self, session_id: str, home: str) -> None:
        """A session that moved (its home was busy) left an older copy on the card it came from: free
        every such copy too, in the background (a busy card gets to it after its current turn)."""
        for record in self.registry.records():
            if record.identity is None or record.card_id == home:
                continue
            self._in_background(record.actor.close_session.remote(session_id))

    def _close_copy(self, card_id: str, session_id: str) -> None:
        try:
            actor = self.registry.actor(card_id)
        except KeyError:
            return
        self._in_background(actor.close_session.remote(session_id))

    def _in_background(self, call: Awaitable[Any]) -> None:
        """A card call nobody waits for (failures are ignored), kept alive until it ends."""
        task = asyncio.ensure_future(self._quietly(call))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- listings -------------------------------------------------------------------------------
    async def ListCards(
        self, request: pb.ListCardsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListCardsResponse:
        await self._caller(context)
        records = self.registry.records()
        statuses = await asyncio.gather(*(self._card_status(r) if r.identity else _none() for r in records))
        phases = self.scheduler.card_phases()
        loading = await self.registry.loading_fractions()
        cards = []
        for record, status in zip(records, statuses, strict=True):
            fraction = 0.0
            if record.state == "up" and record.card_id in phases:
                state = _CARD_STATES[phases[record.card_id]]
            elif record.state == "starting" and record.load_key in loading:
                state, fraction = pb.CARD_STATE_LOADING, loading[record.load_key]
            elif record.state == "starting":
                state = pb.CARD_STATE_STARTING
            else:
                state = pb.CARD_STATE_DOWN
            status = status or {}
            cards.append(
                convert.card_to_proto(
                    record.identity,
                    card_id=record.card_id,
                    state=state,
                    restarts=record.restarts,
                    cached_sessions=int(status.get("cached_sessions", 0)),
                    cached_session_bytes=int(status.get("cached_session_bytes", 0)),
                    loading_fraction=fraction,
                )
            )
        return pb.ListCardsResponse(cards=cards)

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSessionsResponse:
        caller = await self._caller(context)
        bindings = {
            session_id: binding
            for session_id, binding in self.scheduler.bindings().items()
            if self.owners.visible_to(caller, session_id)
        }
        card_ids = sorted({b.card_id for b in bindings.values()})
        listings = await asyncio.gather(*(self._card_sessions(card_id) for card_id in card_ids))
        held: dict[tuple[str, str], SessionRecord] = {}
        for card_id, records in zip(card_ids, listings, strict=True):
            for record in records:
                held[(card_id, record.session_id)] = record
        sessions = [
            convert.session_to_proto(
                session_id,
                b.card_id,
                b.turns,
                b.last_used_wall,
                held.get((b.card_id, session_id)),
                user=self.owners.owner_of(session_id),
            )
            for session_id, b in sorted(bindings.items())
        ]
        return pb.ListSessionsResponse(sessions=sessions)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        await self._caller(context)
        info = self.registry.model_info
        if info is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "no card has started yet: the model info is unknown"
            )
        assert info is not None
        return convert.model_info_to_proto(info)

    async def GetPoolStatus(
        self, request: pb.GetPoolStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.PoolStatus:
        await self._caller(context)
        counts = self.registry.state_counts()
        starting = sum(r.state == "starting" for r in self.registry.records())
        return pb.PoolStatus(
            queue_depth=len(self.scheduler.queue),
            queue_capacity=self.scheduler.queue.capacity,
            cards_free=counts["free"],
            cards_busy=counts["busy"],
            cards_down=counts["down"] - starting,
            cards_starting=starting,
            sessions=len(self.scheduler.bindings()),
            draining=self.draining,
            in_flight=len(self._inflight),
        )

    # ---- helpers --------------------------------------------------------------------------------
    async def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """Who calls a unary RPC; ends the call UNAUTHENTICATED when keys are on and it has no valid one."""
        try:
            return self._authenticated(context)
        except PoolError as e:
            await context.abort(e.code, e.message)
        raise AssertionError("unreachable")

    async def _card_status(self, record: CardRecord) -> dict[str, Any] | None:
        """A card's status for a listing; a card found dead is taken down now, so the listing shows it."""
        identity = record.identity
        try:
            return await asyncio.wait_for(record.actor.status.remote(), self.config.call_timeout_s)
        except asyncio.TimeoutError:
            return None
        except RayError as e:
            what = f"is unreachable: {_first_line(e)}"
            self.registry.report_failure(record.card_id, what, hung=False, seen=identity)
            return None

    async def _card_sessions(self, card_id: str) -> list[SessionRecord]:
        try:
            actor = self.registry.actor(card_id)
        except KeyError:
            return []
        return await self._quietly(actor.sessions.remote()) or []

    async def _quietly(self, call: Awaitable[T]) -> T | None:
        """A listing call to a card: None when the card is slow or gone (listings never fail for it)."""
        try:
            return await asyncio.wait_for(call, self.config.call_timeout_s)
        except (asyncio.TimeoutError, RayError):
            return None

    async def _call(
        self, call: Awaitable[T], timeout_s: float, card_id: str, context: grpc.aio.ServicerContext
    ) -> T:
        try:
            return await asyncio.wait_for(call, timeout_s)
        except asyncio.TimeoutError:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"card {card_id} did not answer within {timeout_s:.0f}s"
            )
        except RayTaskError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"card {card_id} failed: {_first_line(e)}")
        except RayError as e:
            self.registry.report_failure(card_id, "is unreachable", hung=False)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"card {card_id} is unreachable: {_first_line(e)}"
            )
        raise AssertionError("unreachable")


def _raise_if_stopped(entry: _InFlight, context: grpc.aio.ServicerContext) -> None:
    """Cancellation (Abort, or the client going away) also reaches the handler as a task cancel, but
    Python 3.11's `asyncio.wait_for` can swallow a cancel that races a completing wait: check the flags
    at every step too."""
    if entry.aborted or context.cancelled():
        raise asyncio.CancelledError


async def _next_object(call: LinkCall) -> object:
    return await call.next()


async def _none() -> None:
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

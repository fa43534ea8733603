"""What every API module shares: the router, the chat template, the model's name, and running one turn."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from aiohttp import web
from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.worker.api import MAX_ID_CHARS
from onestream.worker.prefixes import TEAM_SCOPE

from .errors import ApiError, bad_field
from .events import Event, Reasoning, Text
from .reasoning import OutputParser
from .template import ChatTemplate
from .upstream import InProcessRouter, Turn, credentials

SESSION_HEADER = "x-session-id"
# Builds the API's own error for a prompt that leaves no room (prompt tokens, the context).
ContextError = Callable[[int, int], ApiError]


def output_budget(prompt_tokens: int, max_context: int, requested: int | None, overflow: ContextError) -> int:
    """The most tokens a turn may generate: what the client asked for, cut to what fits beside the prompt
    (as llama-server does: agents ask for 32K-64K whatever the window), or, when it asked for no limit,
    everything that fits. A prompt that leaves not one token is the API's context-length error."""
    room = max_context - prompt_tokens
    if room < 1:
        raise overflow(prompt_tokens, max_context)
    return room if requested is None else min(requested, room)


@dataclass
class Service:
    router: InProcessRouter
    template: ChatTemplate
    model: str  # the served model's name (/v1/models); requests may name any model
    # The opt-in (`serve --http-user-sessions`): a request's `user` field pins its session when it sends
    # no x-session-id. Off by default: `user` usually names a person, whose parallel conversations
    # would then share (and keep evicting) one session's cache.
    user_sessions: bool = False
    # The pool's `--prefix-sharing`: who may profit from what one caller's prompt leaves behind.
    prefix_sharing: str = "user"
    # The cards' context length, from the router's model info (the first request asks for it).
    _max_context: int | None = field(default=None, init=False, repr=False)

    @property
    def max_context(self) -> int | None:
        """The cards' context length, once a request asked the router for it (None before)."""
        return self._max_context

    async def model_info(self, request: web.Request) -> pb.ModelInfo:
        """The router's model info, with the caller's key (which the router checks)."""
        info = await self.router.model_info(credentials(request.headers))
        self._max_context = info.max_context or None
        return info

    async def output_budget(
        self, request: web.Request, prompt_tokens: int, requested: int | None, overflow: ContextError
    ) -> int | None:
        """`output_budget` against the cards' context (see there); the client's limit as it is where the
        model reports no context (the cards then apply their own default)."""
        if self._max_context is None:
            await self.model_info(request)
        if self._max_context is None:
            return requested
        if prompt_tokens >= self._max_context:
            await self.model_info(request)  # the key first: a caller without one hears 401, not the window
        return output_budget(prompt_tokens, self._max_context, requested, overflow)

    def memo_scope(self, request: web.Request) -> str:
        """Where the tokenizer remembers a caller's prompt segments (worker/segment_encoding.py): per key, as the
        router keeps shared prefixes per user, so that how fast a prompt encodes tells no caller what another
        sent; the team's when the pool shares prefixes across it, or when callers carry no key."""
        key = dict(credentials(request.headers)).get("authorization")
        if self.prefix_sharing == "team" or not key:
            return TEAM_SCOPE
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass
class TurnSpec:
    """A turn as the APIs describe it, in the router's terms."""

    prompt_ids: Sequence[int]
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    sampling: pb.SamplingParams = field(default_factory=pb.SamplingParams)
    constraint: pb.OutputConstraint | None = None

    def request(self, session_id: str) -> pb.GenerateRequest:
        message = pb.GenerateRequest(session_id=session_id, stop=self.stop, sampling=self.sampling)
        message.token_ids.ids.extend(self.prompt_ids)
        if self.constraint is not None:
            message.constraint.CopyFrom(self.constraint)
        if self.max_tokens is not None:
            message.max_tokens = self.max_tokens
        return message


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class Generation:
    """One turn through the router, its text run through the output parser.

    `start()` returns once the router took the turn, queued or on a card (its refusals surface as ApiError,
    before any response is sent); `events()` waits for the card, then yields the parsed events of each chunk;
    `finished` holds the final message. `close()` cancels the gRPC call (a client that went away frees its
    card at once)."""

    def __init__(
        self,
        service: Service,
        request: web.Request,
        spec: TurnSpec,
        parser: OutputParser | None,
        session_id: str | None = None,
        user: str | None = None,
    ) -> None:
        """The turn's session: the x-session-id header, else `session_id` (a body field that names one,
        the Responses API's prompt_cache_key), else the body's `user` where the server opted in, else none
        (routed by its prompt's tokens)."""
        self.created = int(time.time())
        self._service = service
        self._metadata = credentials(request.headers)
        pinned_by_user = service.user_sessions and bool(user)
        if pinned_by_user and len(user or "") > MAX_ID_CHARS:
            raise bad_field("user", f"is a session id here: at most {MAX_ID_CHARS} characters")
        session = request.headers.get(SESSION_HEADER) or session_id or (user if pinned_by_user else "")
        self._request = spec.request(session or "")
        self._parser = parser
        self._turn: Turn | None = None
        self.finished: pb.Finished | None = None

    async def start(self, prefill: str = "") -> list[Event]:
        self._turn = self._service.router.generate(self._request, self._metadata)
        await self._turn.admitted()
        if not prefill or self._parser is None:
            return []
        # The prefill's own text is the client's, not the answer; a call it starts is the answer's.
        return [e for e in self._parser.feed(prefill) if not isinstance(e, (Text, Reasoning))]

    async def events(self) -> AsyncIterator[list[Event]]:
        assert self._turn is not None
        await self._turn.assigned()
        async for item in self._turn.events():
            if isinstance(item, pb.Finished):
                self.finished = item
                break
            if item.text:
                yield self._parser.feed(item.text) if self._parser is not None else [Text(item.text)]
        if self._parser is not None:
            yield self._parser.finish()

    async def stream(self, first: list[Event]) -> AsyncIterator[list[Event]]:
        """`first` (what `start` returned), then the events of each chunk."""
        yield first
        async for events in self.events():
            yield events

    async def all_events(self, first: list[Event]) -> list[Event]:
        """The whole turn's events, for the non-streaming answers."""
        return [event async for events in self.stream(first) for event in events]

    @property
    def tool_calls(self) -> int:
        return self._parser.tool_calls if self._parser is not None else 0

    @property
    def usage(self) -> pb.Usage:
        return self.finished.usage if self.finished is not None else pb.Usage()

    @property
    def stopped_by_length(self) -> bool:
        return self.finished is not None and self.finished.finish_reason == "length"

    def close(self) -> None:
        if self._turn is not None:
            self._turn.cancel()

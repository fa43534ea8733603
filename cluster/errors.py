"""Errors of the pool and the gRPC status code each one ends a call with."""

from __future__ import annotations

import grpc
from onestream.worker.errors import ContextLengthError, InvalidRequestError, UnknownSessionError

# Reasons of `onestream_router_rejections_total` (docs/metrics.md).
QUEUE_FULL = "queue_full"
INVALID_ARGUMENT = "invalid_argument"
DEADLINE = "deadline"
DRAINING = "draining"
NO_CARDS = "no_cards"
UNAUTHENTICATED = "unauthenticated"
PERMISSION_DENIED = "permission_denied"
USER_CONCURRENT = "user_concurrent"
USER_QUEUED = "user_queued"


class PoolError(Exception):
    """A request the pool ends with `code`; `reason` is the rejection label when it never got a card;
    `retry_after_s` is the hint a RESOURCE_EXHAUSTED status carries (trailing metadata `retry-after-s`)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str | None = None,
        *,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.retry_after_s = retry_after_s


class CardFailure(Exception):
    """A card died, hung or became unreachable while serving a request."""

    def __init__(self, card_id: str, what: str) -> None:
        super().__init__(f"card {card_id} {what}")
        self.card_id = card_id


# Engine errors travel from the card to the router by class name (see cluster/card.py `CardError`).
_ENGINE_ERROR_CODES: dict[str, grpc.StatusCode] = {
    InvalidRequestError.__name__: grpc.StatusCode.INVALID_ARGUMENT,
    ContextLengthError.__name__: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownSessionError.__name__: grpc.StatusCode.NOT_FOUND,
}


def code_for_engine_error(kind: str) -> grpc.StatusCode:
    """The status code of an engine error class name; INTERNAL for anything unexpected."""
    return _ENGINE_ERROR_CODES.get(kind, grpc.StatusCode.INTERNAL)

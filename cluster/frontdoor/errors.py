"""Errors of the HTTP APIs: one exception, the HTTP status of each gRPC code, and each API's error body."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from ..auth import RETRY_AFTER as RETRY_AFTER_METADATA  # the router's hint, in seconds

DEFAULT_RETRY_AFTER_S = 1

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# OpenAI's error types by HTTP status; Anthropic's differ in a few names.
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
ANTHROPIC_TYPES = OPENAI_TYPES | {413: "request_too_large", 503: "overloaded_error", 504: "api_error"}


class ApiError(Exception):
    """An answer other than success: its HTTP status, a message naming what was wrong, the field (`param`),
    and OpenAI's machine-readable `code` where clients act on one (context_length_exceeded)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.code = code

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}

    def openai_body(self) -> dict[str, Any]:
        kind = OPENAI_TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_TYPES.get(
            self.status, "api_error" if self.status >= 500 else "invalid_request_error"
        )
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def bad_field(field: str, message: str) -> ApiError:
    """400 for one request field: the message starts with the field's path."""
    return ApiError(400, f"{field}: {message}", param=field)


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


# A prompt that leaves no room for an answer, in the words each API's clients look for: agents compact
# their history on these (OpenAI's code and vLLM's message; Anthropic's "prompt is too long").
def chat_context_error(prompt_tokens: int, max_context: int, *, what: str = "messages") -> ApiError:
    message = (
        f"This model's maximum context length is {max_context} tokens. However, your {what} resulted in "
        f"{prompt_tokens} tokens. Please reduce the length of the {what}."
    )
    return ApiError(400, message, param=what, code=CONTEXT_LENGTH_EXCEEDED)


def completion_context_error(prompt_tokens: int, max_context: int) -> ApiError:
    return chat_context_error(prompt_tokens, max_context, what="prompt")


def responses_context_error(prompt_tokens: int, max_context: int) -> ApiError:
    message = (
        f"Your input exceeds the context window of this model ({prompt_tokens} tokens; the window holds "
        f"{max_context}). Please adjust your input and try again."
    )
    return ApiError(400, message, param="input", code=CONTEXT_LENGTH_EXCEEDED)


def anthropic_context_error(prompt_tokens: int, max_context: int) -> ApiError:
    return ApiError(400, f"prompt is too long: {prompt_tokens} tokens > {max_context} maximum")


def from_status(
    code: grpc.StatusCode, details: str | None, trailing_metadata: Iterable[tuple[str, Any]] | None = ()
) -> ApiError:
    """The HTTP answer to a router call that ended with `code`: its status, the router's message,
    Retry-After on 429/503 (the router's hint in the trailing metadata, else a default)."""
    status = HTTP_STATUS.get(code, 500)
    retry_after = None
    if status in (429, 503):
        retry_after = DEFAULT_RETRY_AFTER_S
        for key, value in trailing_metadata or ():
            if key == RETRY_AFTER_METADATA and str(value).isdigit():
                retry_after = int(value)
    return ApiError(status, details or code.name.lower(), retry_after_s=retry_after)

"""Every router status the HTTP front door can meet becomes its HTTP status, in each API's error shape,
with Retry-After where a retry helps (the router's own hint when it gives one)."""

from __future__ import annotations

import grpc
import pytest
from onestream.cluster.frontdoor.errors import (
    DEFAULT_RETRY_AFTER_S,
    RETRY_AFTER_METADATA,
    ApiError,
    anthropic_context_error,
    chat_context_error,
    from_status,
    responses_context_error,
)
from onestream.cluster.frontdoor.service import output_budget
from onestream.cluster.frontdoor.upstream import credentials


@pytest.mark.parametrize(
    ("code", "status", "openai_type", "anthropic_type"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error", "authentication_error"),
        (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error", "permission_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "not_found_error", "not_found_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", "overloaded_error"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout", "api_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error", "api_error"),
    ],
)
def test_each_status_code_maps_to_its_http_status_and_error_types(
    code: grpc.StatusCode, status: int, openai_type: str, anthropic_type: str
) -> None:
    error = from_status(code, "what went wrong")
    assert error.status == status
    assert error.openai_body()["error"] == {
        "message": "what went wrong",
        "type": openai_type,
        "param": None,
        "code": None,
    }
    assert error.anthropic_body() == {
        "type": "error",
        "error": {"type": anthropic_type, "message": "what went wrong"},
    }
    retries = status in (429, 503)
    assert error.headers == ({"Retry-After": str(DEFAULT_RETRY_AFTER_S)} if retries else {})


def test_the_routers_retry_hint_becomes_retry_after() -> None:
    error = from_status(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "user u1 has 4 requests queued", ((RETRY_AFTER_METADATA, "7"),)
    )
    assert (error.status, error.headers) == (429, {"Retry-After": "7"})


def test_credentials_travel_as_a_bearer_token() -> None:
    assert credentials({"Authorization": "Bearer k1"}) == [("authorization", "Bearer k1")]
    assert credentials({"x-api-key": "k2"}) == [("authorization", "Bearer k2")]  # Anthropic's header
    assert credentials({}) == []


@pytest.mark.parametrize(
    ("prompt", "requested", "budget"),
    [
        (100, None, 924),  # no limit asked: everything that fits
        (100, 64, 64),
        (100, 32000, 924),  # more than fits: cut, as llama-server does
        (1023, None, 1),  # the last token of the context
        (1023, 8, 1),
    ],
)
def test_the_output_budget_is_what_fits_beside_the_prompt(
    prompt: int, requested: int | None, budget: int
) -> None:
    assert output_budget(prompt, 1024, requested, chat_context_error) == budget


@pytest.mark.parametrize("prompt", [1024, 5000])
def test_a_prompt_that_leaves_no_room_is_each_apis_context_error(prompt: int) -> None:
    with pytest.raises(ApiError) as raised:
        output_budget(prompt, 1024, None, chat_context_error)
    assert raised.value.status == 400
    assert raised.value.openai_body()["error"] == {
        "message": (
            f"This model's maximum context length is 1024 tokens. However, your messages resulted in {prompt} "
            "tokens. Please reduce the length of the messages."
        ),
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    responses = responses_context_error(prompt, 1024).openai_body()["error"]
    assert (responses["code"], responses["param"]) == ("context_length_exceeded", "input")
    assert anthropic_context_error(prompt, 1024).anthropic_body() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": f"prompt is too long: {prompt} tokens > 1024 maximum",
        },
    }

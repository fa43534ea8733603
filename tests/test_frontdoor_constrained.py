"""Constrained answers through the front door, end to end on CPU with the official SDKs: response_format
json_object and tool_choice required / a named tool, which the cards enforce token by token
(worker/constraints/) on the embedded model, which knows neither JSON mode nor tools. The pool here also
opts in to sessions pinned by the `user` field (`serve --http-user-sessions`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anthropic
import openai
import pytest
from onestream.cluster.client import PoolClient
from onestream.cluster.server import PoolThread
from onestream.worker.constraints import OutputConstraint
from onestream.worker.constraints.decoding import grammar_for
from onestream.worker.loading import default_model_dir

pytestmark = pytest.mark.slow

MODEL = "default_model"
# A tool whose every parameter has a closed type: a forced call of it is complete within a few tokens.
SET_FLAGS_SCHEMA = {
    "type": "object",
    "properties": {"verbose": {"type": "boolean"}, "level": {"type": "null"}},
    "required": ["verbose", "level"],
}
SET_FLAGS = {"type": "function", "function": {"name": "set_flags", "parameters": SET_FLAGS_SCHEMA}}
LIST_DIR = {
    "type": "function",
    "function": {
        "name": "list_dir",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}
# The embedded model, a code model, echoes a JSON object it is shown (and rambles on other prompts until
# max_tokens: such answers are checked as prefixes of JSON objects).
JSON_PROMPT = [{"role": "user", "content": '{"a": 1}'}]


@pytest.fixture(scope="module")
def pool_cards() -> tuple[int, ...]:
    return (2,)


@pytest.fixture(scope="module")
def pool_model_dir() -> str:
    return str(default_model_dir())


@pytest.fixture(scope="module")
def pool_settings() -> dict[str, Any]:
    return {
        "http_address": "127.0.0.1:0",
        "http_user_sessions": True,
        "engine_options": {"max_context": 1024},
        "home_wait_s": 0.5,
    }


@pytest.fixture(scope="module")
def base_url(pool: PoolThread) -> str:
    return f"http://{pool.http_address}/v1"


@pytest.fixture(scope="module")
def openai_sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def json_prefix(text: str) -> bool:
    """Whether `text` starts a JSON object (the grammar the cards enforce; tests/test_constraints.py checks
    it against Python's json module)."""
    grammar = grammar_for(OutputConstraint("json_object"))
    return grammar.advance(grammar.start(), text.encode()) is not None


def test_json_object_answers_are_json_whole_and_streamed(openai_sdk: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL, "messages": JSON_PROMPT, "response_format": {"type": "json_object"},
        "max_tokens": 24, "temperature": 0, "extra_body": {"repetition_penalty": 1.0},
    }  # fmt: skip
    whole = openai_sdk.chat.completions.create(**request)
    text = whole.choices[0].message.content or ""
    assert whole.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)
    chunks = list(openai_sdk.chat.completions.create(**request, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_json_object_with_thinking_on_skips_the_reasoning(openai_sdk: openai.OpenAI) -> None:
    completion = openai_sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}],
        response_format={"type": "json_object"}, max_tokens=16,
        temperature=1.0, seed=5, extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )  # fmt: skip
    text = completion.choices[0].message.content or ""
    assert text.startswith("{") and json_prefix(text), text
    assert not getattr(completion.choices[0].message, "reasoning_content", None)


def test_responses_text_format_json_object(openai_sdk: openai.OpenAI) -> None:
    response = openai_sdk.responses.create(
        model=MODEL, input="Reply with a JSON object.", text={"format": {"type": "json_object"}},
        max_output_tokens=16, temperature=0,
    )  # fmt: skip
    assert response.output_text.startswith("{") and json_prefix(response.output_text)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_makes_a_complete_call(openai_sdk: openai.OpenAI, stream: bool) -> None:
    request: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Turn on verbose output."}],
        "tools": [SET_FLAGS], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 96,
        "temperature": 0,
    }  # fmt: skip
    if stream:
        chunks = list(openai_sdk.chat.completions.create(**request, stream=True))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        name = deltas[0].function.name
        arguments = json.loads("".join(d.function.arguments or "" for d in deltas if d.index == 0))
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = openai_sdk.chat.completions.create(**request).choices[0]
        call = (choice.message.tool_calls or [])[0]
        name, arguments, finish = (
            call.function.name,
            json.loads(call.function.arguments),
            choice.finish_reason,
        )
    assert finish == "tool_calls"
    assert name == "set_flags"
    assert isinstance(arguments["verbose"], bool) and arguments["level"] is None


def test_a_named_tool_is_the_one_called(openai_sdk: openai.OpenAI) -> None:
    completion = openai_sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "List the files."}], tools=[LIST_DIR, SET_FLAGS],
        tool_choice={"type": "function", "function": {"name": "set_flags"}}, max_tokens=96, temperature=0,
    )  # fmt: skip
    (call, *_) = completion.choices[0].message.tool_calls or []
    assert call.function.name == "set_flags"
    assert set(json.loads(call.function.arguments)) == {"verbose", "level"}


def test_anthropic_tool_choice_any_is_a_tool_use(base_url: str) -> None:
    claude = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    message = claude.messages.create(
        model=MODEL, max_tokens=96, messages=[{"role": "user", "content": "Turn on verbose output."}],
        tools=[{"name": "set_flags", "input_schema": SET_FLAGS_SCHEMA}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    assert message.stop_reason == "tool_use"
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "set_flags" and isinstance(block.input["verbose"], bool)


def test_unsupported_formats_are_a_400_naming_the_field(openai_sdk: openai.OpenAI) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match=r"response_format\.type"):
        openai_sdk.chat.completions.create(model=MODEL, messages=JSON_PROMPT, response_format=schema)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="response_format"):
        openai_sdk.chat.completions.create(
            model=MODEL, messages=[*JSON_PROMPT, {"role": "assistant", "content": "{"}],
            response_format={"type": "json_object"}, extra_body={"continue_final_message": True},
        )  # fmt: skip


# ---- the user field as a session (the opt-in) ----------------------------------------------------------
def test_the_user_field_pins_a_session(
    openai_sdk: openai.OpenAI, base_url: str, grpc_client: PoolClient
) -> None:
    conversation = f"conversation-{uuid.uuid4().hex[:8]}"
    messages: list[Any] = [{"role": "user", "content": "def add(a, b):"}]
    first = openai_sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, user=conversation
    )
    assert conversation in {s.session_id for s in grpc_client.sessions()}
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "x"},
    ]
    second = openai_sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, user=conversation
    )
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    # Anthropic's metadata.user_id is the same field; the header still wins over both.
    claude = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    claude.messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}],
        metadata={"user_id": f"{conversation}-claude"},
    )  # fmt: skip
    pinned = f"{conversation}-header"
    openai_sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, user=conversation,
        extra_headers={"x-session-id": pinned},
    )  # fmt: skip
    sessions = {s.session_id for s in grpc_client.sessions()}
    assert {f"{conversation}-claude", pinned} <= sessions
    with pytest.raises(openai.BadRequestError, match="user"):
        openai_sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, user="u" * 300
        )

"""The HTTP front door end to end on CPU, with the official `openai` and `anthropic` SDKs as clients: one
pool (a local Ray instance, 2 CPU cards, the embedded model) serving the OpenAI, Anthropic and Responses
APIs through the router's own gRPC API. The pool opts in to sessions pinned by the `user` field
(`serve --http-user-sessions`)."""

from __future__ import annotations

import http.client
import itertools
import json
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from typing import Any

import anthropic
import openai
import pytest
import ray
from onestream.cluster.client import PoolClient
from onestream.cluster.config import PoolConfig
from onestream.cluster.frontdoor.app import FrontDoor
from onestream.cluster.server import PoolThread
from onestream.cluster.testing import wait_for
from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.worker.constraints import OutputConstraint
from onestream.worker.constraints.decoding import grammar_for
from onestream.worker.loading import default_model_dir
from pool_helpers import scrape, total

pytestmark = pytest.mark.slow

CARDS = 2
MAX_CONTEXT = 1024
MODEL = "default_model"
KEEPALIVE_S = 0.5  # a quiet event stream's comment interval: short, so every stream here carries some
NEVER_STOP = {"0": -100, "2": -100}  # the embedded model's end tokens banned: a turn runs to its limit
WRITE_FILE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write a Python file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
}


# tests/conftest.py builds the cluster, the router and `grpc_client` from these; `client` here is the
# OpenAI SDK's.
@pytest.fixture(scope="module")
def pool_cards() -> tuple[int, ...]:
    return (CARDS,)


@pytest.fixture(scope="module")
def pool_model_dir() -> str:
    return str(default_model_dir())


@pytest.fixture(scope="module")
def pool_settings() -> dict[str, Any]:
    return {
        "http_address": "127.0.0.1:0",
        "http_user_sessions": True,
        "engine_options": {"max_context": MAX_CONTEXT},
        "home_wait_s": 0.5,
        "http_keepalive_s": KEEPALIVE_S,
    }


@pytest.fixture(scope="module")
def base_url(pool: PoolThread) -> str:
    return f"http://{pool.http_address}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def post(
    base_url: str, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        base_url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


# ---- OpenAI Chat Completions --------------------------------------------------------------------------
def test_chat_completion_answers_with_usage(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]},
        ],
        max_tokens=8,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None and completion.usage.completion_tokens <= 8
    assert completion.usage.prompt_tokens > 10
    assert (
        completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    )


def test_streamed_chat_matches_the_whole_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "import os\n"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_stream_and_whole_agree(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens <= 10
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=["def fib(n):"], max_tokens=10, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_completions_stop_and_usage_in_the_stream(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(**request)
    text = whole.choices[0].text
    assert "\n" in text.strip("\n"), text  # the answer runs on past a line: a stop at "\n" cuts it
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    stopped = client.completions.create(**request, stop=["\n", "never"])
    assert stopped.choices[0].text == text[: text.index("\n")]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**request, stop="\n", stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == stopped.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop" and streamed[-1].usage is None


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI) -> None:
    """Clients migrating from max_tokens send both: OpenAI reads max_completion_tokens."""

    def generated(**limits: int) -> int:
        completion = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "def f():"}], temperature=0,
            logit_bias=NEVER_STOP, **limits,
        )  # fmt: skip
        assert completion.choices[0].finish_reason == "length" and completion.usage is not None
        return completion.usage.completion_tokens

    assert generated(max_completion_tokens=3, max_tokens=9) == 3
    assert generated(max_completion_tokens=9, max_tokens=3) == 9
    assert generated(max_tokens=5) == 5


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL
    assert (card.model_extra or {}) == {"max_model_len": MAX_CONTEXT, "context_length": MAX_CONTEXT}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-9")


def test_reasoning_is_split_from_the_answer(client: openai.OpenAI) -> None:
    """With enable_thinking the template opens `<think>`: what the model writes before `</think>` is
    reasoning (this model never closes it, so all of it is), in both fields agents read."""
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=6,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    message = completion.choices[0].message
    extra = message.model_extra or {}
    assert extra["reasoning_content"] and extra["reasoning"] == extra["reasoning_content"]
    assert not message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "def add(a, b):"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
    )
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    assert streamed == extra["reasoning_content"]


def test_reasoning_effort_is_the_thinking_switch(client: openai.OpenAI) -> None:
    """Chat's `reasoning_effort` (opencode, LiteLLM) and Responses' `reasoning.effort` (Codex): none and
    minimal turn the template's thinking off, other levels on; `chat_template_kwargs` says it outright."""

    def reasoning(**request: Any) -> str | None:
        completion = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=4,
            temperature=0, **request,
        )  # fmt: skip
        return (completion.choices[0].message.model_extra or {}).get("reasoning_content")

    assert reasoning(reasoning_effort="high")
    assert not reasoning(reasoning_effort="minimal")
    assert not reasoning(
        reasoning_effort="low", extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )

    def items(effort: str) -> list[str]:
        response = client.responses.create(
            model=MODEL,
            input="def add(a, b):",
            reasoning={"effort": effort},
            max_output_tokens=4,
            temperature=0,
        )  # type: ignore[arg-type]
        return [item.type for item in response.output]

    assert items("high") == ["reasoning"] and items("none") == ["message"]


def tool_turn_messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You can write files."},
        {"role": "user", "content": "Save the script."},
        # The embedded model knows no tools: the call's start is the assistant's prefix, and the model writes
        # the argument itself until the stop string.
        {"role": "assistant", "content": "<tool_call>\n<function=write_file>\n<parameter=content>\nimport"},
    ]


def test_a_tool_round_trip_through_the_openai_sdk(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL, "messages": tool_turn_messages(), "tools": [WRITE_FILE], "stop": ["\n"],
        "max_tokens": 48, "temperature": 0, "extra_body": {"continue_final_message": True},
    }  # fmt: skip
    first = client.chat.completions.create(**request)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "write_file" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"content"} and arguments["content"].startswith("import")
    assert len(arguments["content"]) > len("import")
    streamed = list(client.chat.completions.create(**request, stream=True))
    deltas = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "write_file" and deltas[0].id
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    # The result goes back; the template renders the call and its result, and the model answers.
    history = [
        *tool_turn_messages()[:2],
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "saved 12 bytes"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WRITE_FILE], max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_takes_no_call(
    client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """Agents switch tool_choice per turn: the prompt keeps its prefix (the tools), the output stays text."""
    request: dict[str, Any] = {
        "model": MODEL, "messages": tool_turn_messages(), "tools": [WRITE_FILE], "stop": ["\n"],
        "max_tokens": 48, "temperature": 0, "extra_body": {"continue_final_message": True},
    }  # fmt: skip
    auto = client.chat.completions.create(**request)
    none = client.chat.completions.create(**request, tool_choice="none")
    assert auto.choices[0].finish_reason == "tool_calls"
    assert none.choices[0].finish_reason == "stop" and not none.choices[0].message.tool_calls
    assert none.choices[0].message.content
    assert none.usage is not None and auto.usage is not None
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens
    tool: Any = {"name": "write_file", "input_schema": WRITE_FILE["function"]["parameters"]}
    counts = [
        claude.messages.count_tokens(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            tools=[tool],
            tool_choice={"type": kind},
        ).input_tokens
        for kind in ("auto", "none")
    ]  # type: ignore[misc]
    assert counts[0] == counts[1]
    # Anthropic's {"type": "none"}: the same call-shaped output is text, whole and streamed.
    messages: Any = tool_turn_messages()[1:]
    anthropic_request: dict[str, Any] = {
        "model": MODEL, "max_tokens": 48, "tools": [tool], "messages": messages, "stop_sequences": ["\n"],
    }  # fmt: skip
    assert claude.messages.create(**anthropic_request).stop_reason == "tool_use"
    message = claude.messages.create(**anthropic_request, tool_choice={"type": "none"})
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "\n")
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    assert message.content[0].text == none.choices[0].message.content
    with claude.messages.stream(**anthropic_request, tool_choice={"type": "none"}) as stream:
        deltas = {e.delta.type for e in stream if e.type == "content_block_delta"}
        final = stream.get_final_message()
    assert deltas == {"text_delta"} and final.content[0].text == message.content[0].text  # type: ignore[union-attr]


# Two calls in one turn: the first whole in the assistant's prefix, the second begun there and finished by
# the model until the stop string (the prefix's calls are the answer's, as with the one-call turns above).
TWO_CALLS = (
    "<tool_call>\n<function=write_file>\n<parameter=content>\nimport os\n</parameter>\n</function>\n</tool_call>"
    "\n<tool_call>\n<function=write_file>\n<parameter=content>\nimport"
)


def two_call_messages() -> list[dict[str, Any]]:
    return [*tool_turn_messages()[:2], {"role": "assistant", "content": TWO_CALLS}]


@pytest.mark.parametrize("parallel", [True, False])
def test_two_tool_calls_in_one_turn_through_the_openai_sdk(client: openai.OpenAI, parallel: bool) -> None:
    """Each call its own index and id, whole and streamed; `parallel_tool_calls: false` keeps the first."""
    request: dict[str, Any] = {
        "model": MODEL, "messages": two_call_messages(), "tools": [WRITE_FILE], "stop": ["\n"],
        "max_tokens": 48, "temperature": 0, "parallel_tool_calls": parallel,
        "extra_body": {"continue_final_message": True},
    }  # fmt: skip
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls or []
    assert [call.function.name for call in calls] == ["write_file"] * (2 if parallel else 1)
    assert len({call.id for call in calls}) == len(calls)
    arguments = [json.loads(call.function.arguments) for call in calls]
    assert arguments[0] == {"content": "import os"}
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    heads = [d for d in deltas if d.id]
    assert [(d.index, d.function.name) for d in heads] == [(i, "write_file") for i in range(len(calls))]
    assert len({d.id for d in heads}) == len(heads) and {d.index for d in deltas} == set(range(len(calls)))
    streamed = [
        json.loads("".join(d.function.arguments or "" for d in deltas if d.index == i))
        for i in range(len(calls))
    ]
    assert streamed == arguments and chunks[-1].choices[0].finish_reason == "tool_calls"
    if parallel:
        second = arguments[1]["content"]
        assert second.startswith("import") and len(second) > len("import")  # the model wrote its end


@pytest.mark.parametrize("parallel", [True, False])
def test_two_tool_use_blocks_in_one_turn_through_the_anthropic_sdk(
    claude: anthropic.Anthropic, parallel: bool
) -> None:
    """`disable_parallel_tool_use` keeps the first call."""
    tool: Any = {"name": "write_file", "input_schema": WRITE_FILE["function"]["parameters"]}
    request: dict[str, Any] = {
        "model": MODEL, "max_tokens": 48, "tools": [tool], "messages": two_call_messages()[1:],
        "stop_sequences": ["\n"], "tool_choice": {"type": "auto", "disable_parallel_tool_use": not parallel},
    }  # fmt: skip
    message = claude.messages.create(**request)
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [block.type for block in message.content] == ["tool_use"] * (2 if parallel else 1)
    assert len({use.id for use in uses}) == len(uses) and uses[0].input == {"content": "import os"}
    with claude.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(i, "tool_use") for i in range(len(uses))]
    assert len({e.content_block.id for e in starts}) == len(starts)  # type: ignore[union-attr]
    deltas: list[Any] = [e for e in events if e.type == "content_block_delta"]
    inputs = [
        json.loads("".join(e.delta.partial_json for e in deltas if e.index == i)) for i in range(len(uses))
    ]
    assert inputs == [use.input for use in uses]
    assert [
        b.input for b in final.content if b.type == "tool_use"
    ] == inputs and final.stop_reason == "tool_use"


def test_a_named_tool_choice_forces_that_call(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Save it."}],
        tools=[WRITE_FILE],
        tool_choice={"type": "function", "function": {"name": "write_file"}},
        max_tokens=8,
        temperature=0,
    )
    (call,) = completion.choices[0].message.tool_calls or []
    assert call.function.name == "write_file"
    assert isinstance(json.loads(call.function.arguments), dict)


# ---- Anthropic Messages --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=120
    )


def test_messages_and_their_stream_agree_and_count_tokens_matches(claude: anthropic.Anthropic) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 10,
        "system": [{"type": "text", "text": "You write Python."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "def mean(xs):"}]}],
    }
    message = claude.messages.create(**request)
    assert message.role == "assistant" and message.stop_reason in ("end_turn", "max_tokens")
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens <= 10
    counted = claude.messages.count_tokens(**{k: v for k, v in request.items() if k != "max_tokens"})
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    with claude.messages.stream(**request) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == message.content[0].text and final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens


def test_text_blocks_of_a_turn_are_kept_apart(claude: anthropic.Anthropic) -> None:
    """Claude Code sends <system-reminder> blocks beside the user's text: a newline between blocks."""
    reminder = "<system-reminder>\nBe brief.\n</system-reminder>"
    blocks: Any = [{"type": "text", "text": reminder}, {"type": "text", "text": "def mean(xs):"}]
    joined = f"{reminder}\ndef mean(xs):"
    counts = [
        claude.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": content}]
        ).input_tokens
        for content in (blocks, joined)
    ]
    assert counts[0] == counts[1]


def test_thinking_comes_back_as_thinking_blocks(claude: anthropic.Anthropic) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 6,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "def add(a, b):"}],
    }
    message = claude.messages.create(**request)
    assert [block.type for block in message.content] == ["thinking"] and message.content[0].thinking
    with claude.messages.stream(**request) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert set(deltas) == {"thinking_delta"} and final.content[0].thinking == message.content[0].thinking


def test_adaptive_thinking_is_thinking_on(claude: anthropic.Anthropic, base_url: str) -> None:
    """Claude Code 2.1 at high effort sends `thinking: adaptive` and `output_config`."""
    request: dict[str, Any] = {
        "model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "def add(a, b):"}],
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
    }  # fmt: skip
    status, _, message = post(base_url, "/messages", request)
    assert status == 200 and [block["type"] for block in message["content"]] == ["thinking"], message
    counted = claude.messages.count_tokens(
        model=MODEL,
        messages=request["messages"],
        thinking={"type": "adaptive"},  # type: ignore[arg-type]
    )
    assert (
        counted.input_tokens == message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"]
    )


def test_a_stop_sequence_is_named(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL,
        max_tokens=48,
        messages=[{"role": "user", "content": "import"}, {"role": "assistant", "content": "import"}],
        stop_sequences=["\n"],
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "\n")


def test_a_tool_round_trip_through_the_anthropic_sdk(claude: anthropic.Anthropic) -> None:
    tool = {
        "name": "write_file",
        "description": "Write a Python file",
        "input_schema": WRITE_FILE["function"]["parameters"],
    }
    user = {"role": "user", "content": "Save the script."}
    prefix = {
        "role": "assistant",
        "content": "<tool_call>\n<function=write_file>\n<parameter=content>\nimport",
    }
    request: dict[str, Any] = {
        "model": MODEL, "max_tokens": 48, "tools": [tool],
        "messages": [user, prefix], "stop_sequences": ["\n"],
    }  # fmt: skip
    message = claude.messages.create(**request)
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert (
        use.name == "write_file" and use.id.startswith("toolu_") and use.input["content"].startswith("import")
    )
    with claude.messages.stream(**request) as stream:
        partial = "".join(
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        )
        final = stream.get_final_message()
    assert json.loads(partial) == use.input and final.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "saved"}]}
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=8,
        tools=[tool],
        messages=[
            user,
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [result]},
        ],
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_history_reasoning_and_tool_errors_reach_the_prompt_as_the_template_has_them(
    client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """The embedded model's template drops earlier turns' reasoning (tests/test_frontdoor_requests.py
    renders one that keeps it), and a tool result with is_error reads "Error: ..." to the model."""
    thought = "I should look at the directory first."
    tool: Any = {
        "name": "shell",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
    use = {"type": "tool_use", "id": "toolu_1", "name": "shell", "input": {"command": "ls /nope"}}

    def counted(assistant: list[Any], result: dict[str, Any]) -> int:
        messages: Any = [
            {"role": "user", "content": "List /nope."},
            {"role": "assistant", "content": assistant},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", **result}]},
        ]
        return claude.messages.count_tokens(model=MODEL, messages=messages, tools=[tool]).input_tokens

    plain = {"content": "No such file"}
    bare = counted([use], plain)
    thinking = {"type": "thinking", "thinking": thought, "signature": "sig"}
    redacted = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}
    assert counted([thinking, use], plain) == counted([redacted, use], plain) == bare
    errored = counted([use], {**plain, "is_error": True})
    assert errored == counted([use], {"content": "Error: No such file"}) > bare

    def prompt_tokens(**reasoning: str) -> int:
        messages: Any = [
            {"role": "user", "content": "def add(a, b):"},
            {"role": "assistant", "content": "return a + b", **reasoning},
            {"role": "user", "content": "def sub(a, b):"},
        ]
        completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        assert completion.usage is not None
        return completion.usage.prompt_tokens

    assert prompt_tokens(reasoning_content=thought) == prompt_tokens(reasoning=thought) == prompt_tokens()


# ---- Responses -----------------------------------------------------------------------------------------
def test_responses_whole_and_streamed(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "instructions": "You write Python.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "def area(r):"}]}
        ],
        "max_output_tokens": 10,
        "temperature": 0,
        "store": False,
    }
    response = client.responses.create(**request)
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage is not None and response.usage.output_tokens <= 10
    events = list(client.responses.create(**request, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_function_call_round_trip_through_the_responses_api(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "write_file", "parameters": WRITE_FILE["function"]["parameters"]}
    forced = client.responses.create(
        model=MODEL,
        input="Save it.",
        tools=[tool],
        tool_choice={"type": "function", "name": "write_file"},
        max_output_tokens=8,
        temperature=0,
    )
    (call,) = [item for item in forced.output if item.type == "function_call"]
    assert call.name == "write_file" and isinstance(json.loads(call.arguments), dict)
    followed = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Save it."},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "saved"},
        ],
        tools=[tool],
        max_output_tokens=8,
        temperature=0,
    )
    assert followed.status in ("completed", "incomplete")
    assert followed.usage is not None and followed.usage.input_tokens > forced.usage.input_tokens


def test_parallel_function_calls_through_the_responses_api(client: openai.OpenAI) -> None:
    """A forced call with parallel calls allowed (the default): the model writes call after call (this
    model never stops on its own; the output limit ends the turn), each its own item, id and call id."""
    ping = {"type": "function", "name": "ping", "parameters": {"type": "object", "properties": {}}}
    request: dict[str, Any] = {
        "model": MODEL, "input": "Ping the hosts.", "tools": [ping], "tool_choice": "required",
        "max_output_tokens": 64, "temperature": 0,
    }  # fmt: skip
    response = client.responses.create(**request)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) >= 2 and [(c.name, c.arguments) for c in calls] == [("ping", "{}")] * len(calls)
    assert len({c.id for c in calls}) == len({c.call_id for c in calls}) == len(calls)
    events = list(client.responses.create(**request, stream=True))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.output_index for e in added] == [e.output_index for e in done] == list(range(len(calls)))
    ids = [e.item.id for e in added]
    assert [e.item_id for e in done] == ids and len(set(ids)) == len(calls)
    final = events[-1].response  # type: ignore[union-attr]
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    assert [c.id for c in streamed] == ids


def test_reasoning_items_go_back_as_they_came(client: openai.OpenAI) -> None:
    """This server's reasoning items carry the text in `content` (summary empty); Codex sends the output
    back in the next request's input as it came (tests/test_frontdoor_requests.py: the text reaches the
    template, which the embedded model's drops for earlier turns)."""
    first = client.responses.create(
        model=MODEL,
        input="def add(a, b):",
        reasoning={"effort": "medium"},
        max_output_tokens=6,
        temperature=0,
    )
    (reasoning,) = [item for item in first.output if item.type == "reasoning"]
    assert reasoning.summary == [] and reasoning.content and reasoning.content[0].text
    history = [{"role": "user", "content": "def add(a, b):"}, reasoning.model_dump(exclude_none=True)]
    history.append({"role": "assistant", "content": "return a + b"})
    followed = client.responses.create(
        model=MODEL, input=[*history, {"role": "user", "content": "def sub(a, b):"}], max_output_tokens=2
    )  # type: ignore[list-item]
    assert followed.status in ("completed", "incomplete")


# ---- sessions, cancellation ----------------------------------------------------------------------------
def second_turn_messages(client: openai.OpenAI, headers: dict[str, str]) -> tuple[Any, Any]:
    """Two turns of one conversation, the second resending the first (as agents do)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You write Python. " * 20},
        {"role": "user", "content": f"# task {uuid.uuid4().hex}\ndef parse(line):"},
    ]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_headers=headers
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "def render(tree):"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_headers=headers
    )
    return first, second


def test_a_pinned_session_reports_its_cached_tokens(client: openai.OpenAI) -> None:
    first, second = second_turn_messages(client, {"x-session-id": f"agent-{uuid.uuid4().hex}"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


def test_a_responses_second_turn_reports_its_cached_tokens(client: openai.OpenAI) -> None:
    """Codex sends its conversation id as prompt_cache_key and the whole input every turn."""
    conversation = uuid.uuid4().hex  # first in the prompt: no other test's turn shares its prefix
    request: dict[str, Any] = {
        "model": MODEL, "prompt_cache_key": f"codex-{conversation}",
        "instructions": f"# {conversation}\n" + "You write Python. " * 20, "max_output_tokens": 8,
        "temperature": 0, "store": False,
    }  # fmt: skip
    history: list[Any] = [{"role": "user", "content": "def parse(line):"}]
    first = client.responses.create(**request, input=history)
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 0
    history += [
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "def render(tree):"},
    ]
    events = list(client.responses.create(**request, input=history, stream=True))
    second = events[-1].response.usage  # type: ignore[union-attr]
    assert second is not None
    assert first.usage.input_tokens <= second.input_tokens_details.cached_tokens < second.input_tokens


def test_a_second_turn_without_a_session_id_hits_the_cards_cache(client: openai.OpenAI) -> None:
    """The router's token-prefix index sends the resent conversation to the card holding it."""
    first, second = second_turn_messages(client, {})
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def occupy_every_card(client: openai.OpenAI) -> list[Any]:
    """A stream on every card that only closing it ends (no end-of-sequence token), its first chunk read."""
    streams = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"def f{i}():"}],
            max_tokens=MAX_CONTEXT - 64,
            temperature=0,
            logit_bias=NEVER_STOP,
            stream=True,
        )
        for i in range(CARDS)
    ]
    for stream in streams:
        next(iter(stream))
    return streams


def test_closing_a_stream_frees_its_card_at_once(client: openai.OpenAI, grpc_client: PoolClient) -> None:
    cancelled_before = cancelled_turns(grpc_client)
    streams = occupy_every_card(client)
    assert grpc_client.pool_status().cards_busy == CARDS
    streams[0].close()
    closed_at = time.monotonic()
    while grpc_client.pool_status().cards_busy == CARDS and time.monotonic() - closed_at < 10:
        time.sleep(0.05)
    freed_after_s = time.monotonic() - closed_at
    assert grpc_client.pool_status().cards_busy == CARDS - 1, "closing the stream freed its card"
    assert freed_after_s < 5.0
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    for stream in streams[1:]:
        stream.close()
    deadline = time.monotonic() + 30
    while grpc_client.pool_status().cards_busy and time.monotonic() < deadline:
        time.sleep(0.1)
    assert grpc_client.pool_status().cards_busy == 0
    # Stopped, not run to their end (which takes these turns a few seconds): each card counted its turn
    # cancelled.
    wait_for(lambda: cancelled_turns(grpc_client) == cancelled_before + CARDS, 10, "the cards to count them")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "def f():"}], "logit_bias": NEVER_STOP},
        ),
        # Greedy: a sampled answer may end by itself before the client leaves (it is then finished, not
        # cancelled), as a loaded CI machine once showed.
        ("/messages", {"messages": [{"role": "user", "content": "x = 1\n" * 20}], "temperature": 0}),
        ("/responses", {"input": "x = 1\n" * 20, "temperature": 0}),
    ],
)
def test_a_client_leaving_a_whole_answer_frees_its_card_at_once(
    base_url: str, grpc_client: PoolClient, path: str, body: dict[str, Any]
) -> None:
    """A non-streaming request whose client goes away (an agent's Esc, a timeout) stops on its card, as a
    closed stream does, though nothing is written to the client until the answer is whole: the card
    counts the turn cancelled (not finished) and is free at once. A whole turn takes the embedded model
    about 3 s, so on a loaded machine it can end before the close reaches it; such a try proves
    nothing and is made again."""
    limit = {"/messages": "max_tokens", "/responses": "max_output_tokens"}.get(path, "max_tokens")
    request = {"model": MODEL, limit: MAX_CONTEXT - 64, **body}
    endings = []
    for _ in range(3):
        endings.append(leave_a_whole_answer(base_url, grpc_client, path, request))
        if endings[-1] == "cancelled":
            return
    pytest.fail(f"every turn ran to its end before its client's leaving reached the card: {endings}")


def leave_a_whole_answer(base_url: str, grpc_client: PoolClient, path: str, request: dict[str, Any]) -> str:
    """How the card ended a turn whose client closed its connection once the card was generating it."""
    wait_for(lambda: grpc_client.pool_status().cards_busy == 0, 30, "the pool to be idle")
    before = turns_by_ending(grpc_client)
    host, port = base_url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1" + path, json.dumps(request), {"Content-Type": "application/json"})
    # The card's own gauge, not the router's count: the router counts a card busy from the moment it hands
    # it the turn, and a client leaving before the card starts the turn leaves the card nothing to count.
    wait_for(lambda: cards_generating(grpc_client) == 1, 30, "the turn on a card")
    connection.close()
    closed_at = time.monotonic()
    wait_for(lambda: grpc_client.pool_status().cards_busy == 0, 10, "the card freed")
    assert time.monotonic() - closed_at < 5.0
    after = wait_for(
        lambda: (now := turns_by_ending(grpc_client)).total() == before.total() + 1 and now,
        10,
        "the card to count the turn",
    )
    (ending,) = (after - before).keys()
    return ending


def cards_generating(grpc_client: PoolClient) -> float:
    return sum(total(scrape(card.metrics_endpoint), "onestream_card_busy") for card in grpc_client.cards())


def turns_by_ending(grpc_client: PoolClient) -> Counter[str]:
    """Every card's turns (its /metrics) by finish reason."""
    counts: Counter[str] = Counter()
    for card in grpc_client.cards():
        for (name, labels), value in scrape(card.metrics_endpoint).items():
            if name == "onestream_requests_total":
                counts[dict(labels).get("finish_reason", "")] += int(value)
    return counts


def cancelled_turns(grpc_client: PoolClient) -> int:
    """Turns the cards stopped because their caller went away (each card's /metrics)."""
    return turns_by_ending(grpc_client)["cancelled"]


def test_a_failure_after_a_stream_started_is_each_apis_error_event(
    client: openai.OpenAI, claude: anthropic.Anthropic, pool: PoolThread, grpc_client: PoolClient
) -> None:
    """The client hears the API's error event (the SDKs raise it or hand it over), not a stream that just
    stops: an OpenAI and an Anthropic stream whose cards die after tokens streamed (killed as
    tests/test_pool.py kills one; Ray restarts them), and a Responses stream that waited past the queue
    timeout behind them."""
    wait_for(lambda: grpc_client.pool_status().cards_busy == 0, 30, "the pool to be idle")
    chat = iter(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "def f():"}], max_tokens=MAX_CONTEXT - 64,
            temperature=0, logit_bias=NEVER_STOP, stream=True,
        )
    )  # fmt: skip
    assert next(chat).choices[0].delta.role == "assistant" and next(chat).choices[0].delta.content
    with claude.messages.stream(
        model=MODEL, max_tokens=MAX_CONTEXT - 256, messages=[{"role": "user", "content": "x = 1\n" * 20}]
    ) as messages:  # this model repeats the lines until the limit
        kinds = [event.type for event in itertools.islice(messages, 3)]
        assert kinds == ["message_start", "content_block_start", "content_block_delta"]
        router = pool.pool.router
        pool.call(setattr, router.config, "queue_timeout_s", 1.0)
        try:
            events: list[Any] = list(
                client.responses.create(model=MODEL, input="x", max_output_tokens=4, stream=True)
            )
        finally:
            pool.call(setattr, router.config, "queue_timeout_s", PoolConfig.queue_timeout_s)
        # Both the `error` event (the SDK's) and `response.failed`, the end of the response (Codex reads
        # only that one: without it, its message is lost).
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        assert [e.type for e in events[-2:]] == ["error", "response.failed"], events[-2:]
        error, failed = events[-2], events[-1].response
        assert "no card became free" in error.message and error.code == "504"
        assert failed.status == "failed" and failed.id == events[0].response.id
        assert (failed.error.code, failed.error.message) == (error.code, error.message)
        killed = [c.card_id for c in grpc_client.cards() if c.state == pb.CARD_STATE_BUSY]
        assert len(killed) == CARDS
        for card_id in killed:
            ray.kill(pool.call(pool.pool.registry.actor, card_id), no_restart=False)
        with pytest.raises(anthropic.APIStatusError, match="mid-stream") as failed:
            kinds += [event.type for event in messages]
    assert "message_stop" not in kinds and failed.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    with pytest.raises(openai.APIError, match="mid-stream") as raised:
        list(chat)
    assert raised.value.type == "service_unavailable"  # type: ignore[attr-defined]

    def cards_back() -> bool:
        cards = {card.card_id: card.state for card in grpc_client.cards()}
        return all(cards.get(card_id) == pb.CARD_STATE_FREE for card_id in killed)

    wait_for(cards_back, 120, f"cards {killed} restarted")


def test_a_queued_stream_is_kept_alive_and_the_sdks_read_past_its_comments(
    client: openai.OpenAI, claude: anthropic.Anthropic, base_url: str, grpc_client: PoolClient
) -> None:
    busy = occupy_every_card(client)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    raw = urllib.request.urlopen(
        urllib.request.Request(
            base_url + "/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        ),
        timeout=60,
    )
    answers: dict[str, str] = {}

    def openai_stream() -> None:
        stream = client.chat.completions.create(**{**body, "max_tokens": 4})
        finishes = [c.choices[0].finish_reason for c in stream if c.choices]
        answers["openai"] = finishes[-1] or ""

    def anthropic_stream() -> None:
        request = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        with claude.messages.stream(**request) as stream:
            answers["anthropic"] = stream.get_final_message().stop_reason or ""

    readers = [threading.Thread(target=openai_stream), threading.Thread(target=anthropic_stream)]
    for reader in readers:
        reader.start()
    try:  # headers at once, then comments while every card is busy
        assert raw.status == 200 and raw.headers["Content-Type"] == "text/event-stream"
        comments, started = 0, time.monotonic()
        while comments < 3:
            line = raw.readline()
            comments += line == b": keep-alive\n"
            assert time.monotonic() - started < 30, "no keep-alive comments while queued"
        wait_for(lambda: grpc_client.pool_status().queue_depth == 3, 60, "both SDK streams queued too")
    finally:
        for stream in busy:
            stream.close()
    events = [json.loads(line[6:]) for line in raw.read().splitlines() if line.startswith(b"data: {")]
    raw.close()
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    for reader in readers:
        reader.join(60)
    assert answers.get("openai") in ("stop", "length")
    assert answers.get("anthropic") in ("end_turn", "max_tokens")


# ---- constrained answers (worker/constraints/: the cards enforce them token by token) ---------------
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


def json_prefix(text: str) -> bool:
    """Whether `text` starts a JSON object (the grammar the cards enforce; tests/test_constraints.py checks
    it against Python's json module)."""
    grammar = grammar_for(OutputConstraint("json_object"))
    return grammar.advance(grammar.start(), text.encode()) is not None


def test_json_object_answers_are_json_whole_and_streamed(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL, "messages": JSON_PROMPT, "response_format": {"type": "json_object"},
        "max_tokens": 24, "temperature": 0, "extra_body": {"repetition_penalty": 1.0},
    }  # fmt: skip
    whole = client.chat.completions.create(**request)
    text = whole.choices[0].message.content or ""
    assert whole.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_json_object_with_thinking_on_skips_the_reasoning(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}],
        response_format={"type": "json_object"}, max_tokens=16,
        temperature=1.0, seed=5, extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )  # fmt: skip
    text = completion.choices[0].message.content or ""
    assert text.startswith("{") and json_prefix(text), text
    assert not getattr(completion.choices[0].message, "reasoning_content", None)


def test_responses_text_format_json_object(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Reply with a JSON object.", text={"format": {"type": "json_object"}},
        max_output_tokens=16, temperature=0,
    )  # fmt: skip
    assert response.output_text.startswith("{") and json_prefix(response.output_text)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_makes_a_complete_call(client: openai.OpenAI, stream: bool) -> None:
    request: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Turn on verbose output."}],
        "tools": [SET_FLAGS], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 96,
        "temperature": 0,
    }  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**request, stream=True))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        name = deltas[0].function.name
        arguments = json.loads("".join(d.function.arguments or "" for d in deltas if d.index == 0))
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**request).choices[0]
        call = (choice.message.tool_calls or [])[0]
        name, arguments, finish = (
            call.function.name,
            json.loads(call.function.arguments),
            choice.finish_reason,
        )
    assert finish == "tool_calls"
    assert name == "set_flags"
    assert isinstance(arguments["verbose"], bool) and arguments["level"] is None


def test_a_named_tool_is_the_one_called(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
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


def test_anthropic_named_tool_streams_its_input(base_url: str) -> None:
    claude = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    tools: Any = [
        {"name": "list_dir", "input_schema": LIST_DIR["function"]["parameters"]},
        {"name": "set_flags", "input_schema": SET_FLAGS_SCHEMA},
    ]
    with claude.messages.stream(
        model=MODEL, max_tokens=96, messages=[{"role": "user", "content": "List the files."}], tools=tools,
        tool_choice={"type": "tool", "name": "set_flags", "disable_parallel_tool_use": True},
    ) as stream:  # fmt: skip
        deltas = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        message = stream.get_final_message()
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "set_flags" and message.stop_reason == "tool_use"
    assert len(deltas) > 1 and json.loads("".join(deltas)) == block.input


def test_responses_tool_choice_required_is_a_function_call(client: openai.OpenAI) -> None:
    function = {"type": "function", "name": "set_flags", "parameters": SET_FLAGS_SCHEMA}
    response = client.responses.create(
        model=MODEL, input="Turn on verbose output.", tools=[function],  # type: ignore[list-item]
        tool_choice="required", parallel_tool_calls=False, max_output_tokens=96, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "set_flags" and set(json.loads(call.arguments)) == {"verbose", "level"}


# What Codex declares in every request: functions, the freeform apply_patch, an MCP server's namespace, and
# tools only OpenAI's servers run (left out here).
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'},
}
CODEX_TOOLS: list[Any] = [
    {"type": "function", "name": "shell", "parameters": LIST_DIR["function"]["parameters"]},
    APPLY_PATCH,
    {"type": "namespace", "name": "mcp__flags__", "description": "Flags.",
     "tools": [{"type": "function", "name": "set_flags", "parameters": SET_FLAGS_SCHEMA}]},
    {"type": "web_search"},
    {"type": "local_shell"},
]  # fmt: skip


def test_codex_custom_tools_round_trip_as_custom_tool_calls(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL, "input": "Fix the bug.", "tools": CODEX_TOOLS,
        "tool_choice": {"type": "custom", "name": "apply_patch"}, "parallel_tool_calls": False,
        "max_output_tokens": 16, "temperature": 0, "store": False,
    }  # fmt: skip
    response = client.responses.create(**request)
    (call,) = [item for item in response.output if item.type == "custom_tool_call"]
    assert call.name == "apply_patch" and call.call_id and isinstance(call.input, str)
    events = list(client.responses.create(**request, stream=True))
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done.input == call.input
    assert "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta") == call.input
    (item,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert item.type == "custom_tool_call" and item.input == call.input
    # The call and its output go back in the next request's input, as Codex sends them.
    history = [
        {"role": "user", "content": "Fix the bug."},
        {"type": "custom_tool_call", "call_id": call.call_id, "name": call.name, "input": call.input},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"},
    ]
    followed = client.responses.create(
        **request | {"input": history, "tool_choice": "auto", "max_output_tokens": 4}
    )
    assert followed.usage is not None and followed.usage.input_tokens > response.usage.input_tokens


def test_a_namespaced_tools_call_names_its_namespace(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Turn on verbose output.", tools=CODEX_TOOLS,
        tool_choice={"type": "function", "name": "set_flags"}, parallel_tool_calls=False,
        max_output_tokens=96, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert (call.name, call.namespace) == ("set_flags", "mcp__flags__")
    assert set(json.loads(call.arguments)) == {"verbose", "level"}


def test_a_json_schema_is_answered_with_a_json_object(client: openai.OpenAI) -> None:
    """The cards enforce a JSON object, not the schema below its root (docs/http.md)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    completion = client.chat.completions.create(
        model=MODEL, messages=JSON_PROMPT, max_tokens=24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
        extra_body={"repetition_penalty": 1.0},
    )  # fmt: skip
    text = completion.choices[0].message.content or ""
    assert completion.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)
    response = client.responses.create(
        model=MODEL, input="Reply with a JSON object.", max_output_tokens=16, temperature=0,
        text={"format": {"type": "json_schema", "name": "a", "schema": schema}},
    )  # fmt: skip
    assert response.output_text.startswith("{") and json_prefix(response.output_text)


def test_unsupported_formats_are_a_400_naming_the_field(client: openai.OpenAI) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}}
    with pytest.raises(openai.BadRequestError, match=r"response_format\.json_schema\.schema\.type"):
        client.chat.completions.create(model=MODEL, messages=JSON_PROMPT, response_format=schema)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=MODEL, messages=[*JSON_PROMPT, {"role": "assistant", "content": "{"}],
            response_format={"type": "json_object"}, extra_body={"continue_final_message": True},
        )  # fmt: skip


# ---- the user field as a session (the opt-in) ----------------------------------------------------------
def test_the_user_field_pins_a_session(client: openai.OpenAI, base_url: str, grpc_client: PoolClient) -> None:
    conversation = f"conversation-{uuid.uuid4().hex[:8]}"
    messages: list[Any] = [{"role": "user", "content": "def add(a, b):"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, user=conversation
    )
    assert conversation in {s.session_id for s in grpc_client.sessions()}
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "x"},
    ]
    second = client.chat.completions.create(
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
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, user=conversation,
        extra_headers={"x-session-id": pinned},
    )  # fmt: skip
    sessions = {s.session_id for s in grpc_client.sessions()}
    assert {f"{conversation}-claude", pinned} <= sessions
    with pytest.raises(openai.BadRequestError, match="user"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, user="u" * 300
        )


# ---- images: a placeholder, so that a conversation that once held one goes on ----------------------------
PLACEHOLDER = "[image omitted: this model reads text only]"
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def test_an_image_in_a_chat_message_stands_as_a_placeholder(client: openai.OpenAI) -> None:
    def prompt_tokens(part: dict[str, Any]) -> int:
        content: Any = [{"type": "text", "text": "What does this show?"}, part]
        completion = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=1
        )
        assert completion.usage is not None
        return completion.usage.prompt_tokens

    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
    assert prompt_tokens(image) == prompt_tokens({"type": "text", "text": PLACEHOLDER})


def test_images_in_anthropic_turns_and_tool_results_stand_as_placeholders(
    claude: anthropic.Anthropic,
) -> None:
    """Claude Code sends screenshots in user turns and in tool results (its Read tool on an image)."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    text = {"type": "text", "text": PLACEHOLDER}

    def counted(block: dict[str, Any]) -> int:
        use = {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.png"}}
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [block]}
        messages: Any = [
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, block]},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]},
        ]
        tool = {
            "name": "read",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
        return claude.messages.count_tokens(model=MODEL, messages=messages, tools=[tool]).input_tokens  # type: ignore[list-item]

    assert counted(image) == counted(text)
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": [image, text]}],  # type: ignore[list-item]
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")


# ---- the context window: output limits, prompts that do not fit ---------------------------------------
def lines(count: int) -> str:
    """A prompt of about 5 tokens a line."""
    return "x = 1\n" * count


def test_a_turn_without_a_limit_may_fill_the_context(client: openai.OpenAI) -> None:
    """No max_tokens (Aider, Cline, Codex send none): everything that fits beside the prompt."""
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": lines(120)}], temperature=0, logit_bias=NEVER_STOP
    )
    used = completion.usage
    assert used is not None and completion.choices[0].finish_reason == "length"
    assert used.completion_tokens > 256 and used.prompt_tokens + used.completion_tokens == MAX_CONTEXT


def test_a_responses_turn_without_max_output_tokens_is_not_refused(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=lines(190), temperature=0)
    assert response.usage is not None and response.usage.input_tokens > MAX_CONTEXT - 256
    total = response.usage.input_tokens + response.usage.output_tokens
    assert total == MAX_CONTEXT if response.status == "incomplete" else total < MAX_CONTEXT


def test_a_limit_past_the_context_is_cut_to_what_fits(
    client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """Claude Code asks for 32000 output tokens whatever the window, opencode too: cut, never refused."""
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": lines(190)}], temperature=0,
        max_completion_tokens=MAX_CONTEXT * 2, logit_bias=NEVER_STOP,
    )  # fmt: skip
    assert completion.usage is not None and completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens + completion.usage.completion_tokens == MAX_CONTEXT
    message = claude.messages.create(
        model=MODEL, max_tokens=32000, messages=[{"role": "user", "content": lines(190)}]
    )
    used = message.usage
    total = used.input_tokens + (used.cache_read_input_tokens or 0) + used.output_tokens
    assert total == MAX_CONTEXT if message.stop_reason == "max_tokens" else total < MAX_CONTEXT


def test_a_prompt_past_the_context_gets_each_apis_context_error(client: openai.OpenAI, base_url: str) -> None:
    """The wording and code each API's clients recognise (and compact their history on)."""
    too_long = [{"role": "user", "content": lines(220)}]
    status, _, answer = post(base_url, "/chat/completions", {"model": MODEL, "messages": too_long})
    error = answer["error"]
    assert status == 400 and (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert re.fullmatch(
        f"This model's maximum context length is {MAX_CONTEXT} tokens. However, your messages resulted in "
        r"\d+ tokens. Please reduce the length of the messages.",
        error["message"],
    ), error
    with pytest.raises(openai.BadRequestError) as raised:  # streamed: refused before the stream opens
        client.chat.completions.create(model=MODEL, messages=too_long, stream=True)  # type: ignore[arg-type]
    assert raised.value.code == "context_length_exceeded"
    status, _, answer = post(base_url, "/messages", {"model": MODEL, "max_tokens": 8, "messages": too_long})
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    assert re.fullmatch(
        rf"prompt is too long: \d+ tokens > {MAX_CONTEXT} maximum", answer["error"]["message"]
    )
    status, _, answer = post(base_url, "/responses", {"model": MODEL, "input": lines(220)})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    status, _, answer = post(base_url, "/completions", {"model": MODEL, "prompt": [5] * MAX_CONTEXT})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer


# ---- bad input ----------------------------------------------------------------------------------------
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MESSAGES = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
BAD_INPUT = [
    # path, body, status, what the message names
    ("/chat/completions", {k: v for k, v in CHAT.items() if k != "model"}, 400, "model"),
    ("/chat/completions", CHAT | {"messages": "hi"}, 400, "messages"),
    ("/chat/completions", CHAT | {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    (
        "/chat/completions",
        CHAT | {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        400,
        "messages[0].content[0]",
    ),
    ("/chat/completions", CHAT | {"n": 2}, 400, "n"),
    (
        "/chat/completions",
        CHAT | {"response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema",
    ),
    ("/chat/completions", CHAT | {"response_format": {"type": "grammar"}}, 400, "response_format.type"),
    ("/chat/completions", CHAT | {"tools": [{"type": "retrieval"}]}, 400, "tools[0].type"),
    (
        "/chat/completions",
        CHAT | {"tools": [WRITE_FILE], "tool_choice": {"type": "function", "function": {"name": "rm"}}},
        400,
        "tool_choice",
    ),
    ("/chat/completions", CHAT | {"tool_choice": "required"}, 400, "tool_choice"),
    ("/chat/completions", CHAT | {"temperature": "hot"}, 400, "temperature"),
    ("/chat/completions", CHAT | {"temperature": 500}, 400, "temperature"),
    ("/chat/completions", CHAT | {"top_p": 0}, 400, "top_p"),
    ("/chat/completions", CHAT | {"seed": -1}, 400, "seed"),
    ("/chat/completions", CHAT | {"max_tokens": 0}, 400, "max_tokens"),
    ("/chat/completions", CHAT | {"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/chat/completions", CHAT | {"logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("/chat/completions", CHAT | {"stop": [1]}, 400, "stop[0]"),
    ("/chat/completions", CHAT | {"logprobs": True}, 400, "logprobs"),
    ("/chat/completions", CHAT | {"chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs.tools"),
    (
        "/chat/completions",
        CHAT
        | {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                }
            ]
        },
        400,
        "messages[0].tool_calls[0].function.arguments",
    ),
    ("/chat/completions", b"{not json", 400, "body"),
    ("/chat/completions", [1, 2], 400, "body"),
    ("/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/completions", {"model": MODEL, "prompt": "a", "echo": True}, 400, "echo"),
    ("/messages", {k: v for k, v in MESSAGES.items() if k != "max_tokens"}, 400, "max_tokens"),
    ("/messages", MESSAGES | {"messages": [{"role": "system", "content": "x"}]}, 400, "messages[0].role"),
    (
        "/messages",
        MESSAGES | {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        400,
        "messages[0].content[0].source.type",
    ),
    ("/messages", MESSAGES | {"thinking": {"type": "sometimes"}}, 400, "thinking.type"),
    ("/messages", MESSAGES | {"tools": [{"name": "t"}]}, 400, "tools[0].input_schema"),
    ("/messages", MESSAGES | {"tool_choice": {"type": "maybe"}}, 400, "tool_choice.type"),
    ("/messages/count_tokens", {"model": MODEL}, 400, "messages"),
    ("/responses", {"model": MODEL}, 400, "input"),
    ("/responses", RESPONSES | {"input": [{"type": "web_search_call"}]}, 400, "input[0].type"),
    ("/responses", RESPONSES | {"tools": [{"type": "custom"}]}, 400, "tools[0].name"),
    ("/responses", RESPONSES | {"tools": [{"type": "namespace", "name": "n"}]}, 400, "tools[0].tools"),
    ("/responses", RESPONSES | {"tool_choice": {"type": "custom", "name": "nope"}}, 400, "tool_choice"),
    ("/responses", RESPONSES | {"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ("/responses", RESPONSES | {"text": {"format": {"type": "json_schema"}}}, 400, "text.format.schema"),
    ("/nowhere", {}, 404, "/v1/nowhere"),
    ("/messages/nowhere", {}, 404, "/v1/messages/nowhere"),
]


@pytest.mark.parametrize(("path", "body", "status", "field"), BAD_INPUT)
def test_bad_input_gets_its_status_and_names_the_field(
    base_url: str, path: str, body: Any, status: int, field: str
) -> None:
    got, _, answer = post(base_url, path, body)
    assert got == status, answer
    if path.startswith("/messages"):
        assert answer["type"] == "error" and field in answer["error"]["message"], answer
    else:
        assert field in answer["error"]["message"], answer
        assert answer["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert "Traceback" not in json.dumps(answer)


def test_a_wrong_method_is_405(base_url: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(base_url + "/chat/completions", timeout=30)
    assert (
        error.value.code == 405
        and "GET /v1/chat/completions" in json.loads(error.value.read())["error"]["message"]
    )


def test_an_oversized_body_is_413(pool: PoolThread) -> None:
    """A second front door with a small body limit, on the same router."""
    door = FrontDoor(
        model=MODEL,
        model_dir=str(default_model_dir()),
        router=pool.pool.router,
        host="127.0.0.1",
        port=0,
        max_body_bytes=4096,
    )
    pool.run(door.start())
    try:
        big = CHAT | {"messages": [{"role": "user", "content": "x" * 8192}]}
        status, _, answer = post(f"http://{door.endpoint}/v1", "/chat/completions", big)
        assert status == 413 and "too large" in answer["error"]["message"]
        status, _, answer = post(f"http://{door.endpoint}/v1", "/messages", MESSAGES | big)
        assert status == 413 and answer["error"]["type"] == "request_too_large"
    finally:
        pool.run(door.stop())


def test_draining_answers_503_with_retry_after(pool: PoolThread, base_url: str) -> None:
    router = pool.pool.router
    pool.call(setattr, router, "draining", True)
    try:
        status, headers, answer = post(base_url, "/chat/completions", CHAT)
        assert status == 503 and headers["Retry-After"].isdigit() and "draining" in answer["error"]["message"]
        status, _, answer = post(base_url, "/messages", MESSAGES)
        assert status == 503 and answer["error"]["type"] == "overloaded_error"
    finally:
        pool.call(setattr, router, "draining", False)

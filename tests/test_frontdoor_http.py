"""The HTTP front door end to end on CPU, with the official `openai` and `anthropic` SDKs as clients: one
pool (a local Ray instance, 2 CPU cards, the embedded model) serving the OpenAI, Anthropic and Responses
APIs through the router's own gRPC API."""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
import ray
from onestream.cluster.client import PoolClient
from onestream.cluster.config import PoolConfig
from onestream.cluster.server import PoolThread
from onestream.worker.card import CPU_CARD_RESOURCE
from onestream.worker.loading import default_model_dir

pytestmark = pytest.mark.slow

CARDS = 2
MAX_CONTEXT = 1024
WAIT_S = 180.0
MODEL = "default_model"
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


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolThread]:
    ray.init(
        address="local",
        num_cpus=CARDS,
        resources={CPU_CARD_RESOURCE: CARDS},
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    config = PoolConfig(
        model_dir=str(default_model_dir()),
        grpc_address="127.0.0.1:0",
        metrics_address="127.0.0.1:0",
        http_address="127.0.0.1:0",
        cpu_cards=CARDS,
        card_torch_threads=1,
        engine_options={"max_context": MAX_CONTEXT},
        home_wait_s=0.5,
        health_interval_s=1.0,
    )
    pool = PoolThread(config)
    try:
        yield pool.start(wait_for_cards=CARDS, ready_timeout_s=WAIT_S)
    finally:
        pool.stop()
        ray.shutdown()


@pytest.fixture(scope="module")
def base_url(pool: PoolThread) -> str:
    return f"http://{pool.http_address}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(pool: PoolThread) -> Iterator[PoolClient]:
    with PoolClient(pool.grpc_address, timeout_s=60.0) as client:
        yield client


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


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
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


def tool_turn_messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You can write files."},
        {"role": "user", "content": "Save the script."},
        # The embedded model knows no tools: the call's start is the assistant's prefix, and the model writes
        # the argument itself until the stop string.
        {"role": "assistant", "content": "<tool_call>\n<function=write_file>\n<parameter=content>\nimport"},
    ]


def test_a_tool_round_trip_through_the_openai_sdk(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=tool_turn_messages(),
        tools=[WRITE_FILE],
        stop=["\n"],
        max_tokens=48,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "write_file" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"content"} and arguments["content"].startswith("import")
    assert len(arguments["content"]) > len("import")
    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            messages=tool_turn_messages(),
            tools=[WRITE_FILE],
            stop=["\n"],
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"continue_final_message": True},
        )
    )
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

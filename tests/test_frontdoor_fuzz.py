"""The HTTP APIs against an adversarial client: bodies of realistic agent turns (tools, tool calls and
results, reasoning, images, documents) with values replaced by any JSON value or removed, sent to a real
pool's front door. Each must be answered (a turn, or a 4xx in the API's error shape that names what was
wrong), never with a 5xx, and leave the pool idle and healthy. The embedded model (its template renders
tools) on one CPU card with a short context, so that any turn a body starts is short."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onestream.cluster.client import PoolClient
from onestream.cluster.server import PoolThread
from onestream.worker.loading import default_model_dir
from pool_helpers import assert_idle

pytestmark = pytest.mark.slow

WAIT_S = 120.0
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# tests/conftest.py builds the cluster, the router and the client from these.
@pytest.fixture(scope="module")
def pool_cards() -> tuple[int, ...]:
    return (1,)


@pytest.fixture(scope="module")
def pool_model_dir() -> str:
    return str(default_model_dir())


@pytest.fixture(scope="module")
def pool_settings() -> dict[str, Any]:
    return {"http_address": "127.0.0.1:0", "engine_options": {"max_context": 512}, "queue_capacity": 4}


# A realistic turn of each API (the shapes agents send: tools, tool calls and their results, reasoning,
# images and documents), each answer at most 4 tokens, and two forced calls.
WRITE_FILE = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
RICH_SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "mode": {"type": "string", "enum": ["w", "a"]},
        "lines": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
        "options": {"type": "object", "properties": {"force": {"type": "boolean"}}},
        "note": {"type": ["string", "null"]},
    },
    "required": ["path", "lines"],
}
HTTP_TURNS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {
        "model": "default_model",
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "a.py"}'}}
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "written"},
            {"role": "assistant", "content": "Done.", "reasoning_content": "The file is there."},
            {"role": "user", "content": "Now test it."},
        ],
        "tools": [{"type": "function", "function": {"name": "write_file", "parameters": WRITE_FILE}}],
        "tool_choice": "auto",
        "response_format": {"type": "text"},
        "temperature": 0.7,
        "stop": ["\n\n"],
    }),
    ("/v1/messages", {
        "model": "default_model",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "You write Python."}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "hi"},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x = 1"}},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "A file.", "signature": "s"},
                {"type": "tool_use", "id": "t1", "name": "write_file", "input": {"path": "a.py"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "written"}]}
            ]},
        ],
        "tools": [{"name": "write_file", "description": "Write a file.", "input_schema": WRITE_FILE}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "stop_sequences": ["\n\n"],
    }),
    ("/v1/responses", {
        "model": "default_model",
        "max_output_tokens": 4,
        "instructions": "You write Python.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "A file."}]},
            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
        ],
        "tools": [
            {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}},
            {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
        ],
        "reasoning": {"effort": "low"},
    }),
    # Forced calls: the cards build a grammar from the schema, so its every corner is fuzzed too.
    ("/v1/chat/completions", {
        "model": "default_model",
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "Write the file."}],
        "tools": [{"type": "function", "function": {"name": "write_file", "parameters": RICH_SCHEMA}}],
        "tool_choice": "required",
    }),
    ("/v1/messages", {
        "model": "default_model",
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "Write the file."}],
        "tools": [{"name": "write_file", "input_schema": RICH_SCHEMA}],
        "tool_choice": {"type": "tool", "name": "write_file"},
    }),
]  # fmt: skip
JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.sampled_from(
        ["", "user", "assistant", "tool", "system", "text", "auto", "function", "tool_use", "\ud800"]
    ),
    st.text(max_size=6),
    st.just([]),
    st.just({}),
    st.lists(st.sampled_from([None, 1, "x", {}, {"type": "text"}, {"type": None}]), min_size=1, max_size=2),
)


def _places(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path below `value` (dict keys and list indices)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    found = []
    for key, child in items:
        found += [(*at, key), *_places(child, (*at, key))]
    return found


def _mutated(body: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """`body` with 1-3 of its values replaced by any JSON value, or removed."""
    body = copy.deepcopy(body)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        place = data.draw(st.sampled_from(_places(body)), label="place")
        holder = body
        for key in place[:-1]:
            holder = holder[key]
        if data.draw(st.booleans(), label="remove"):
            del holder[place[-1]]
        else:
            holder[place[-1]] = data.draw(JSON_VALUES, label="value")
        if not _places(body):
            break
    return body


def post_json(url: str, body: Any) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@FUZZ
@given(data=st.data())
def test_fuzzed_http_bodies_never_answer_a_server_error(
    pool: PoolThread, client: PoolClient, data: st.DataObject
) -> None:
    path, body = data.draw(st.sampled_from(HTTP_TURNS), label="turn")
    status, answer = post_json(f"http://{pool.http_address}{path}", _mutated(body, data))
    assert status < 500, (status, answer[:400])
    if status >= 400:
        assert json.loads(answer)["error"]["message"], answer[:400]
    assert_idle(client)


def test_the_fuzzed_http_bodies_are_answered_as_they_are(pool: PoolThread) -> None:
    """The bodies the fuzzing starts from are good requests: what it changes is what gets refused."""
    for path, body in HTTP_TURNS:
        status, answer = post_json(f"http://{pool.http_address}{path}", body)
        assert status == 200, (path, answer[:400])

"""Request bodies as the front door reads them, without a server: the Responses API's tools and input
items as Codex sends them, Anthropic's as Claude Code sends them."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import pytest
from onestream.cluster.frontdoor import anthropic_api, responses_api
from onestream.cluster.frontdoor.errors import ApiError
from onestream.cluster.frontdoor.events import Block
from onestream.cluster.frontdoor.openai_api import (
    IMAGE_PLACEHOLDER,
    chat_messages,
    function_tools,
    json_format,
    text_content,
    tool_choice,
)
from onestream.cluster.frontdoor.params import valid_unicode
from onestream.cluster.frontdoor.responses_api import (
    _Items,
    custom_input,
    declared_tools,
    input_messages,
)
from onestream.cluster.frontdoor.template import REQUIRED, ChatTemplate
from onestream.worker.loading import default_model_dir
from onestream.worker.tokenizer import Tokenizer, load_tokenizer

SHELL = {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"},
}
MCP = {
    "type": "namespace",
    "name": "mcp__docs__",
    "description": "Tools of the docs MCP server.",
    "tools": [
        {
            "type": "function",
            "name": "search",
            "description": "Search the docs.",
            "parameters": {"type": "object", "properties": {}},
        }
    ],
}
# What Codex declares in a request: functions, the freeform apply_patch, MCP servers' namespaces, and
# tools only OpenAI's servers run.
CODEX_TOOLS = [SHELL, APPLY_PATCH, MCP, {"type": "web_search"}, {"type": "local_shell"}]


def test_codex_tools_become_functions_the_model_can_call(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(responses_api, "_skipped_logged", set())  # each kind is logged once a process
    with caplog.at_level(logging.INFO, "onestream.cluster.frontdoor.responses_api"):
        tools = {tool.name: tool for tool in declared_tools(CODEX_TOOLS)}
    assert set(tools) == {"shell", "apply_patch", "mcp__docs__search"}
    patch = tools["apply_patch"]
    assert patch.custom and patch.parameters["required"] == ["input"]
    assert "begin_patch hunk+" in patch.parameters["properties"]["input"]["description"]
    search = tools["mcp__docs__search"]
    assert (search.namespace, search.client_name) == ("mcp__docs__", "search")
    # The namespace says what its server is for: the model reads it with each member.
    assert search.description == "Tools of the docs MCP server.\n\nSearch the docs."
    assert "local_shell, web_search" in caplog.text


def test_a_namespace_without_trailing_underscores_is_joined_with_two() -> None:
    (tool,) = declared_tools([MCP | {"name": "collaboration"}])
    assert tool.name == "collaboration__search"


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ([{"type": "custom"}], "tools[0].name"),
        ([MCP | {"tools": None}], "tools[0].tools"),
        ([MCP | {"tools": ["x"]}], "tools[0].tools[0]"),
        ([SHELL, SHELL], "tools[1].name"),
        ("shell", "tools"),
    ],
)
def test_malformed_tools_are_a_400_naming_the_field(tools: Any, field: str) -> None:
    with pytest.raises(ApiError) as raised:
        declared_tools(tools)
    assert raised.value.status == 400 and raised.value.message.startswith(field)


def test_custom_and_namespaced_calls_in_the_input_render_under_the_models_names() -> None:
    body = {
        "input": [
            {"role": "user", "content": "fix it"},
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
            {
                "type": "function_call",
                "call_id": "c2",
                "namespace": "mcp__docs__",
                "name": "search",
                "arguments": '{"q": "x"}',
            },
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "hit"}],
            },
        ]
    }
    messages = input_messages(body)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool"]
    patch = messages[1]["tool_calls"][0]["function"]
    assert patch == {"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}}
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "Done!"}
    assert messages[3]["tool_calls"][0]["function"]["name"] == "mcp__docs__search"
    assert messages[4]["content"] == "hit"


def test_calls_go_back_as_the_items_their_tools_make() -> None:
    items = _Items({tool.name: tool for tool in declared_tools(CODEX_TOOLS)})
    patch = Block(
        "tool",
        0,
        name="apply_patch",
        text='{"input": "*** Begin Patch"}',
        arguments={"input": "*** Begin Patch"},
    )
    item = items.item(patch, "completed")
    assert item["type"] == "custom_tool_call" and item["id"].startswith("ctc_")
    assert (item["name"], item["input"]) == ("apply_patch", "*** Begin Patch") and "namespace" not in item
    search = items.item(Block("tool", 1, name="mcp__docs__search", text="{}", arguments={}), "completed")
    assert (search["type"], search["name"], search["namespace"]) == ("function_call", "search", "mcp__docs__")
    assert search["arguments"] == "{}"


@pytest.mark.parametrize(
    ("text", "arguments", "expected"),
    [
        ('{"input": "patch"}', {"input": "patch"}, "patch"),
        ('{"input": "pat', None, '{"input": "pat'),  # cut off, not JSON: the text as it came
        ('{"input": "patch"}', None, "patch"),
        ('{"other": 1}', {"other": 1}, '{"other": 1}'),
    ],
)
def test_a_custom_calls_input_is_its_one_argument(text: str, arguments: Any, expected: str) -> None:
    assert custom_input(Block("tool", 0, name="t", text=text, arguments=arguments)) == expected


@pytest.mark.parametrize(
    ("thinking", "switch"),
    [
        (None, {}),
        ({"type": "enabled", "budget_tokens": 1024}, {"enable_thinking": True}),
        ({"type": "adaptive"}, {"enable_thinking": True}),  # Claude Code 2.1 at high effort
        ({"type": "disabled"}, {"enable_thinking": False}),
    ],
)
def test_anthropic_thinking_is_the_templates_switch(thinking: Any, switch: dict[str, bool]) -> None:
    body = {"thinking": thinking, "output_config": {"effort": "high"}}
    assert anthropic_api._thinking(body) == switch


@pytest.mark.parametrize(
    ("effort", "thinking"),
    [("none", False), ("minimal", False), ("low", True), ("medium", True), ("high", True), ("xhigh", True)],
)
def test_responses_reasoning_effort_is_the_templates_thinking_switch(effort: str, thinking: bool) -> None:
    """Codex sends reasoning.effort on every turn; none and minimal mean no reasoning."""
    assert responses_api._template_kwargs({"reasoning": {"effort": effort}}) == {"enable_thinking": thinking}
    assert responses_api._template_kwargs({"reasoning": {"summary": "auto"}}) == {}
    assert responses_api._template_kwargs({}) == {}


THOUGHT = "I should list the files first."


@pytest.mark.parametrize(
    ("reasoning", "kept"),
    [
        ({"summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]}, THOUGHT),  # as we send it
        ({"summary": [{"type": "summary_text", "text": THOUGHT}]}, THOUGHT),  # as OpenAI sends it
        (
            {"summary": [{"type": "summary_text", "text": "a"}, {"type": "summary_text", "text": "b"}]},
            "a\n\nb",
        ),
        ({"summary": [], "encrypted_content": "gAAA"}, None),
    ],
)
def test_reasoning_items_come_back_to_the_template(reasoning: dict[str, Any], kept: str | None) -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"}
    body = {"input": [{"role": "user", "content": "ls"}, {"type": "reasoning", **reasoning}, call]}
    assistant = input_messages(body)[1]
    assert assistant.get("reasoning_content") == kept


# A template that keeps the reasoning of assistant turns (as Qwen3's do for the turn in progress).
REASONING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if m.reasoning_content %}<think>\n"
    "{{ m.reasoning_content }}\n</think>\n\n{%- endif %}{{ m.content }}<|im_end|>\n{%- endfor %}"
    "<|im_start|>assistant\n"
)


def test_reasoning_sent_back_reaches_the_prompt() -> None:
    embedded = load_tokenizer(default_model_dir())
    tokenizer = Tokenizer(
        embedded.backend,
        chat_templates={"default": REASONING_TEMPLATE},
        special_tokens=embedded.special_tokens,
    )
    thought = [{"type": "reasoning_text", "text": THOUGHT}]
    body = {
        "input": [
            {"role": "user", "content": "ls"},
            {"type": "reasoning", "summary": [], "content": thought},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a.py"}]},
        ]
    }
    prompt = asyncio.run(ChatTemplate(tokenizer).render(input_messages(body), [], {}))
    assert f"<think>\n{THOUGHT}\n</think>a.py" in prompt.text


def rendered(messages: list[dict[str, Any]], template: str | None = None) -> str:
    """The prompt text of `messages` under the embedded model's template, or under `template`."""
    embedded = load_tokenizer(default_model_dir())
    tokenizer = embedded
    if template is not None:
        tokenizer = Tokenizer(
            embedded.backend, chat_templates={"default": template}, special_tokens=embedded.special_tokens
        )
    return asyncio.run(ChatTemplate(tokenizer).render(messages, [], {})).text


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_chat_reasoning_sent_back_reaches_a_template_that_keeps_it(field: str) -> None:
    """OpenAI clients send an earlier turn's reasoning back under either name (vLLM's old and new)."""
    messages = chat_messages(
        [
            {"role": "user", "content": "ls"},
            {"role": "assistant", "content": "a.py", field: THOUGHT},
            {"role": "user", "content": "cat a.py"},
        ]
    )
    assert messages[1]["reasoning_content"] == THOUGHT
    assert f"<think>\n{THOUGHT}\n</think>a.py" in rendered(messages, REASONING_TEMPLATE)
    # The embedded model's template drops earlier turns' reasoning, as Qwen's do for finished turns.
    assert THOUGHT not in rendered(messages) and "<|im_start|>assistant\na.py<|im_end|>" in rendered(messages)


def test_anthropic_thinking_blocks_reach_the_template_and_redacted_ones_are_dropped() -> None:
    """Claude Code sends the assistant's thinking back with its signature; redacted thinking carries only
    encrypted data, which no template can read."""
    thinking = {"type": "thinking", "thinking": THOUGHT, "signature": "sig"}
    redacted = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"}
    answer = {"type": "text", "text": "a.py"}
    body = {
        "messages": [
            {"role": "user", "content": "ls"},
            {"role": "assistant", "content": [thinking, answer]},
            {"role": "user", "content": "cat a.py"},
            {"role": "assistant", "content": [redacted, answer]},
            {"role": "user", "content": "again"},
        ]
    }
    messages = anthropic_api.chat_messages(body)
    assert messages[1]["reasoning_content"] == THOUGHT and messages[1]["content"] == "a.py"
    assert "reasoning_content" not in messages[3] and messages[3]["content"] == "a.py"
    text = rendered(messages, REASONING_TEMPLATE)
    assert f"<think>\n{THOUGHT}\n</think>a.py" in text and "EmwKAhgB" not in text
    assert text.count("<think>") == 1
    assert THOUGHT not in rendered(messages)


def test_an_anthropic_tool_result_with_is_error_reaches_the_prompt_marked_as_an_error() -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "shell", "input": {"command": "ls /nope"}}

    def turn(result: dict[str, Any]) -> list[dict[str, Any]]:
        block = {"type": "tool_result", "tool_use_id": "toolu_1", **result}
        body = {
            "messages": [
                {"role": "user", "content": "ls /nope"},
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [block]},
            ]
        }
        messages = anthropic_api.chat_messages(body)
        assert messages[2]["role"] == "tool" and messages[2]["tool_call_id"] == "toolu_1"
        return messages

    failed = turn({"content": "No such file", "is_error": True})
    assert failed[2]["content"] == "Error: No such file"
    assert "<tool_response>\nError: No such file\n</tool_response>" in rendered(failed)
    blocks = [{"type": "text", "text": "No such file"}, {"type": "text", "text": "exit 2"}]
    assert turn({"content": blocks, "is_error": True})[2]["content"] == "Error: No such file\nexit 2"
    assert turn({"content": "No such file", "is_error": False})[2]["content"] == "No such file"
    assert turn({"content": "No such file"})[2]["content"] == "No such file"


def test_image_parts_stand_as_a_placeholder_and_other_parts_are_a_400() -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    body = {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "see: "}, image]},
            {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [image]},
        ]
    }
    messages = input_messages(body)
    assert (
        messages[0]["content"] == f"see: \n{IMAGE_PLACEHOLDER}"
        and messages[2]["content"] == IMAGE_PLACEHOLDER
    )
    chat = text_content(
        [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}], "messages[0].content"
    )
    assert chat == IMAGE_PLACEHOLDER
    with pytest.raises(ApiError, match=r"messages\[0\]\.content\[0\]: only text and image parts"):
        text_content([{"type": "input_file", "file_id": "f"}], "messages[0].content")


def test_anthropic_documents_are_their_text_or_a_placeholder() -> None:
    """Claude Code attaches files as document blocks: plain text and content sources are read under their
    title; a PDF (base64), a URL or a file id stands as a placeholder, in user turns and tool results."""
    pdf = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
    }
    notes = {
        "type": "document",
        "title": "notes.txt",
        "source": {"type": "text", "media_type": "text/plain", "data": "a = 1"},
    }
    parts = {
        "type": "document",
        "source": {"type": "content", "content": [{"type": "text", "text": "b = 2"}]},
    }
    use = {"type": "tool_use", "id": "t1", "name": "read", "input": {}}
    body = {
        "messages": [
            {"role": "user", "content": [notes, parts, pdf]},
            {"role": "assistant", "content": [use]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [pdf, notes]}],
            },
        ]
    }
    messages = anthropic_api.chat_messages(body)
    placeholder = anthropic_api.DOCUMENT_PLACEHOLDER
    assert messages[0]["content"] == f"notes.txt\na = 1\nb = 2\n{placeholder}"
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": "t1",
        "content": f"{placeholder}\nnotes.txt\na = 1",
    }
    bad = {"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "ftp"}}]}]}
    with pytest.raises(ApiError, match=r"messages\[0\]\.content\[0\]\.source\.type: must be"):
        anthropic_api.chat_messages(bad)
    audio = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "audio"}]}],
            }
        ]
    }
    with pytest.raises(ApiError, match=r"content\[0\]: only text, images and documents"):
        anthropic_api.chat_messages(audio)


def test_tool_choice_none_declares_the_tools_and_takes_no_calls() -> None:
    tools = declared_tools([SHELL])
    none = tool_choice("none", tools)
    assert (none.tools, none.forced, none.parse_calls) == (tools, None, False)
    assert tool_choice("auto", tools).parse_calls and not tool_choice("none", []).parse_calls
    assert tool_choice("required", tools).forced is REQUIRED
    assert tool_choice({"type": "function", "function": {"name": "shell"}}, tools).forced == "shell"


def test_text_parts_and_blocks_of_one_message_are_kept_apart() -> None:
    """Claude Code's <system-reminder> blocks and Cline's <task> / <environment_details> parts."""
    reminder, ask = "<system-reminder>\nBe brief.\n</system-reminder>", "Fix the bug."
    parts = [{"type": "text", "text": reminder}, {"type": "text", "text": ask}]
    assert text_content(parts, "content") == f"{reminder}\n{ask}"
    body = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": parts}]}
    user, assistant = anthropic_api.chat_messages(body)
    assert user["content"] == assistant["content"] == f"{reminder}\n{ask}"


@pytest.mark.parametrize(
    ("value", "nested", "json_answer"),
    [
        (None, True, False),
        ({"type": "text"}, True, False),
        ({"type": "json_object"}, True, True),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}, True, True),
        ({"type": "json_schema", "name": "a", "schema": {"properties": {}}}, False, True),  # Responses' form
    ],
)
def test_json_formats_ask_for_a_json_object(value: Any, nested: bool, json_answer: bool) -> None:
    assert json_format(value, "response_format", nested=nested) is json_answer


@pytest.mark.parametrize(
    ("value", "nested", "field"),
    [
        ({"type": "json_schema"}, True, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "a"}}, True, "response_format.json_schema.schema"),
        ({"type": "json_schema", "schema": {"type": "array"}}, False, "response_format.schema.type"),
        ({"type": "regex"}, True, "response_format.type"),
    ],
)
def test_json_formats_that_cannot_be_enforced_are_a_400(value: Any, nested: bool, field: str) -> None:
    with pytest.raises(ApiError) as raised:
        json_format(value, "response_format", nested=nested)
    assert raised.value.param == field


@pytest.mark.parametrize("kind", [["auto"], {"type": "auto"}, 3, None])
def test_an_anthropic_tool_choice_of_another_kind_is_a_400(kind: Any) -> None:
    with pytest.raises(
        ApiError, match=r"tool_choice.type.*must be 'auto', 'any', 'tool' or 'none'"
    ) as raised:
        anthropic_api._choice({"tool_choice": {"type": kind}})
    assert raised.value.status == 400


@pytest.mark.parametrize(
    ("schema", "field"),
    [
        ({"type": "object", "properties": ["path"]}, "tools[0].function.parameters.properties"),
        (
            {"type": "object", "properties": {"path": "string"}},
            "tools[0].function.parameters.properties.path",
        ),
        (
            {"type": "object", "properties": {"n": {"type": 5}}},
            "tools[0].function.parameters.properties.n.type",
        ),
        ({"type": "object", "required": [["path"]]}, "tools[0].function.parameters.required"),
    ],
)
def test_a_tool_schema_the_call_grammar_cannot_read_is_a_400(schema: dict[str, Any], field: str) -> None:
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": schema}}]
    with pytest.raises(ApiError, match=re.escape(field) + ": must be a") as raised:
        function_tools(tools)
    assert raised.value.status == 400


def test_a_lone_surrogate_is_a_400_naming_its_field_and_an_escaped_pair_passes() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "\ud800 alone"}]}).encode()
    with pytest.raises(ApiError, match=r"messages\[0\].content: is not valid Unicode") as raised:
        valid_unicode(json.loads(raw), raw)
    assert raised.value.status == 400
    pair = json.dumps({"messages": [{"role": "user", "content": "\U0001f600"}]}).encode()
    assert b"\\ud83d\\ude00" in pair
    valid_unicode(json.loads(pair), pair)

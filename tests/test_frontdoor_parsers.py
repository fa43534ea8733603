"""The tool-call and reasoning parsers of the HTTP front door, on the output shapes Qwen3.5/3.6 produce and
the failure modes other servers hit: every split of a text into deltas gives what the whole text gives."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onestream.cluster.frontdoor.events import (
    Collected,
    Event,
    Text,
    ToolCall,
    ToolCallArguments,
    ToolCallBegin,
    ToolCallEnd,
)
from onestream.cluster.frontdoor.reasoning import OutputParser
from onestream.cluster.frontdoor.toolcalls import JSON, XML, ToolCallParser, typed_value

TOOLS: dict[str, dict[str, Any]] = {
    "write_file": {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "content": {"type": "string"},
            "mode": {"type": "integer"},
        },
    },
    "run": {
        "type": "object",
        "properties": {
            "cmd": {"type": "string"},
            "timeout": {"type": "number"},
            "env": {"type": "object"},
            "dry": {"type": "boolean"},
            "args": {"type": "array"},
        },
    },
    "list_files": {"type": "object", "properties": {}},
}


PARAMETER = "<parameter="


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CODE = 'def f(a, b):\n    if a < b and b<a:\n        return "<x>"\n    return a <= b\n'
CASES: dict[str, tuple[str, bool, str, str, list[ToolCall]]] = {
    # name: (output, reasoning primed, expected text, expected reasoning, expected calls)
    "one call after prose": (
        "Writing it.\n\n" + xml_call("write_file", path="a.py", content=CODE, mode="420"),
        False,
        "Writing it.\n\n",
        "",
        [ToolCall("write_file", {"path": "a.py", "content": CODE, "mode": 420})],
    ),
    "parallel calls, typed": (
        xml_call("run", cmd="ls -l", timeout="2.5", env='{"A": "1"}', dry="false", args='["-a", 3]')
        + "\n"
        + xml_call("list_files"),
        False,
        "",
        "",
        [
            ToolCall(
                "run", {"cmd": "ls -l", "timeout": 2.5, "env": {"A": "1"}, "dry": False, "args": ["-a", 3]}
            ),
            ToolCall("list_files", {}),
        ],
    ),
    "literal tag in prose and inline code": (
        "The template wraps calls in <tool_call> tags; write `<tool_call>` to start one.",
        False,
        "The template wraps calls in <tool_call> tags; write `<tool_call>` to start one.",
        "",
        [],
    ),
    "a call inside a code fence is code": (
        "Example:\n```xml\n" + xml_call("list_files") + "\n```\nDone.",
        False,
        "Example:\n```xml\n" + xml_call("list_files") + "\n```\nDone.",
        "",
        [],
    ),
    "an undeclared tool is text": (
        xml_call("rm_rf", path="/"),
        False,
        xml_call("rm_rf", path="/"),
        "",
        [],
    ),
    "reasoning then a call": (
        "Need the file list.\n</think>\n\n" + xml_call("list_files"),
        True,
        "",
        "Need the file list.\n",
        [ToolCall("list_files", {})],
    ),
    "a call inside the reasoning block": (
        "I will look first. " + xml_call("list_files") + "\n</think>\n",
        True,
        "",
        "I will look first. ",
        [ToolCall("list_files", {})],
    ),
    "model-opened reasoning": (
        "<think>\nhmm</think>\n\nThe answer is 4.",
        False,
        "The answer is 4.",
        "\nhmm",
        [],
    ),
    "json form": (
        'Ok.\n<tool_call>\n{"name": "run", "arguments": {"cmd": "make", "timeout": 5}}\n</tool_call>',
        False,
        "Ok.\n",
        "",
        [ToolCall("run", {"cmd": "make", "timeout": 5})],
    ),
    # Its arguments streamed as they came: a call that breaks off keeps what arrived (as the XML form's).
    "broken json form ends the call": (
        '<tool_call>\n{"name": "run", "arguments": {"cmd": "make", "timeout": </tool_call> after',
        False,
        "after",
        "",
        [ToolCall("run", {"cmd": "make", "timeout": None})],
    ),
    "json form cut off after a comma": (
        '<tool_call>\n{"name": "run", "arguments": {"cmd": "make",  ',
        False,
        "",
        "",
        [ToolCall("run", {"cmd": "make"})],
    ),
    "json form arguments as a string": (
        '<tool_call>\n{"name": "run", "arguments": "{\\"cmd\\": \\"ls\\"}"}\n</tool_call>',
        False,
        "",
        "",
        [ToolCall("run", {"cmd": "ls"})],
    ),
    "json form arguments holding closing tags and braces": (
        '<tool_call>\n{"name": "run", "arguments": {"cmd": "echo \'}</tool_call>\' [", "n": [1, {"a": {}}]}}\n'
        "</tool_call>\nDone.",
        False,
        "Done.",
        "",
        [ToolCall("run", {"cmd": "echo '}</tool_call>' [", "n": [1, {"a": {}}]})],
    ),
    "json-looking prose is text at once": (
        'Send <tool_call>{"x": 1} and <tool_call>{"name": "nope"} to see.',
        False,
        'Send <tool_call>{"x": 1} and <tool_call>{"name": "nope"} to see.',
        "",
        [],
    ),
    "a call cut off by the end of the stream keeps what arrived": (
        "<tool_call>\n<function=write_file>\n<parameter=path>\nx.py\n</parameter>\n<parameter=content>\nimport o",
        False,
        "",
        "",
        [ToolCall("write_file", {"path": "x.py", "content": "import o"})],
    ),
    "a missing </parameter> before </function>": (
        "<tool_call>\n<function=run>\n<parameter=cmd>\npwd\n</function>\n</tool_call>",
        False,
        "",
        "",
        [ToolCall("run", {"cmd": "pwd"})],
    ),
    "a malformed body ends the call": (
        "<tool_call>\n<function=run>\n<parameter=cmd>\npwd\n</parameter>\noops, prose\n",
        False,
        "oops, prose\n",
        "",
        [ToolCall("run", {"cmd": "pwd"})],
    ),
    "a header that never completes is text": (
        "<tool_call>\n<function=write_fi",
        False,
        "<tool_call>\n<function=write_fi",
        "",
        [],
    ),
}


def parse(
    deltas: list[str], reasoning: bool, formats: tuple[str, ...] = (XML, JSON)
) -> tuple[Collected, list[Event]]:
    parser = OutputParser(reasoning=reasoning, tools=ToolCallParser(TOOLS, formats))
    collected, events = Collected(), []
    for delta in deltas:
        events += parser.feed(delta)
    events += parser.finish()
    collected.add(events)
    return collected, events


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def check_streamed_arguments(events: list[Event], calls: list[ToolCall]) -> None:
    """Each call's fragments concatenated are its final arguments as JSON, and begin comes before them."""
    fragments: dict[int, str] = {}
    for event in events:
        if isinstance(event, ToolCallBegin):
            assert event.index not in fragments
            fragments[event.index] = ""
        elif isinstance(event, ToolCallArguments):
            fragments[event.index] += event.fragment
        elif isinstance(event, ToolCallEnd):
            assert json.loads(fragments[event.index]) == event.arguments
    assert [json.loads(fragments[i]) for i in sorted(fragments)] == [c.arguments for c in calls]


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_output(case: str) -> None:
    output, reasoning, text, thought, calls = CASES[case]
    collected, events = parse([output], reasoning)
    assert (collected.text, collected.reasoning, collected.tool_calls) == (text, thought, calls)
    check_streamed_arguments(events, calls)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(sorted(CASES)), cuts=st.lists(st.integers(min_value=0), max_size=40))
def test_every_split_into_deltas_gives_the_same_result(case: str, cuts: list[int]) -> None:
    output, reasoning, text, thought, calls = CASES[case]
    collected, events = parse(split(output, cuts), reasoning)
    assert (collected.text, collected.reasoning, collected.tool_calls) == (text, thought, calls)
    check_streamed_arguments(events, calls)


def test_one_delta_closing_the_last_parameter_and_the_function() -> None:
    head = "<tool_call>\n<function=run>\n<parameter=cmd>\nmake te"
    collected, events = parse([head, "st\n</parameter>\n</function>\n</tool_call>"], False)
    assert collected.tool_calls == [ToolCall("run", {"cmd": "make test"})]
    assert isinstance(events[-1], ToolCallEnd)


def test_a_call_cut_anywhere_leaks_no_tag() -> None:
    """max_tokens can end the output inside a call's tags: what arrived of the values is kept, a partial tag is
    neither text nor part of a value."""
    whole = xml_call("run", cmd="make test", dry="true") + "\n"
    for end in range(whole.index(PARAMETER), len(whole) + 1):
        collected, events = parse([whole[:end]], False)
        assert collected.text == "", (whole[:end], collected.text)
        [call] = collected.tool_calls
        assert not any("<" in str(v) or str(v).endswith("\n") for v in call.arguments.values()), (
            whole[:end],
            call,
        )
        check_streamed_arguments(events, [call])
    collected, _ = parse([whole[: whole.index("</parameter>", whole.index("dry"))]], False)
    assert collected.tool_calls == [ToolCall("run", {"cmd": "make test", "dry": True})]


def test_json_form_arguments_stream_before_the_call_closes() -> None:
    parser = ToolCallParser(TOOLS, (JSON,))
    events = parser.feed('<tool_call>\n{"name": "run", "arguments": {"cmd": "make te')
    assert [e for e in events if isinstance(e, ToolCallBegin)] == [ToolCallBegin(0, "run")]
    assert "".join(e.fragment for e in events if isinstance(e, ToolCallArguments)) == '{"cmd": "make te'
    events = parser.feed('st", ')
    assert "".join(e.fragment for e in events if isinstance(e, ToolCallArguments)) == 'st"'  # the comma waits
    events = parser.feed('"timeout": 5}}\n</tool_call>')
    assert "".join(e.fragment for e in events if isinstance(e, ToolCallArguments)) == ', "timeout": 5}'
    assert events[-1] == ToolCallEnd(0, {"cmd": "make test", "timeout": 5})


def test_string_arguments_stream_before_the_parameter_closes() -> None:
    parser = ToolCallParser(TOOLS)
    events = parser.feed("<tool_call>\n<function=write_file>\n<parameter=content>\nline one\nline two")
    fragments = "".join(e.fragment for e in events if isinstance(e, ToolCallArguments))
    assert fragments == '{"content": "line one\\nline two'
    assert parser.feed("\n") == []  # a newline may still be the one before </parameter>


@settings(max_examples=60, deadline=None)
@given(
    value=st.text(st.characters(codec="utf-8", exclude_characters="\r"), max_size=60).filter(
        lambda v: "</parameter>" not in v and "</function>" not in v and "</tool_call>" not in v
    ),
    cuts=st.lists(st.integers(min_value=0), max_size=20),
)
def test_any_string_value_round_trips(value: str, cuts: list[int]) -> None:
    output = xml_call("write_file", content=value)
    collected, events = parse(split(output, cuts), False)
    assert collected.tool_calls == [ToolCall("write_file", {"content": value})]
    check_streamed_arguments(events, collected.tool_calls)


def test_text_that_cannot_start_a_call_is_not_held_back() -> None:
    parser = ToolCallParser(TOOLS)
    events = parser.feed('Use <tool_call>{"x": 1} like so')
    assert "".join(e.text for e in events if isinstance(e, Text)) == 'Use <tool_call>{"x": 1} like so'
    events = parser.feed(" and <tool_call>\n<function=ls>\n")  # not a declared tool
    assert "".join(e.text for e in events if isinstance(e, Text)) == " and <tool_call>\n<function=ls>\n"


def test_only_the_templates_format_is_parsed() -> None:
    output = '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>'
    assert parse([output], False, (XML,))[0].text == output
    assert parse([output], False, (JSON,))[0].tool_calls == [ToolCall("list_files", {})]


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("3", {"type": "integer"}, 3),
        ("3.5", {"type": "integer"}, "3.5"),
        (" 2e3 ", {"type": "number"}, 2000.0),
        ("True", {"type": "boolean"}, True),
        ("None", {"type": ["integer", "null"]}, None),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        ("42", {"type": "string"}, "42"),
        ("42", None, "42"),
        ("[1]", {}, [1]),
    ],
)
def test_values_are_typed_by_the_schema(raw: str, schema: dict[str, Any] | None, value: Any) -> None:
    assert typed_value(raw, schema) == value

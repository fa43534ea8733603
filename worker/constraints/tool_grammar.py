"""A forced tool call: the rest of the call whose opening the front door wrote into the prompt.

The forms are the chat templates' (cluster/frontdoor/toolcalls.py parses them back):
XML (Qwen3.5/3.6):  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`
JSON (older Qwen):  `<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`

The prompt ends with `<tool_call>\\n<function=` (any tool: the grammar starts at the name) or with the named
tool's header (it starts at the arguments). XML parameters are the tool's declared ones, each at most once,
the required ones before `</function>`; a parameter whose schema type admits no string is a JSON value of
that type, any other is text (which may not hold the tags that end a value). JSON-form arguments are a JSON
object. After the call the turn ends, or (`parallel`) another call of any declared tool follows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from .grammar import Choice, Grammar, State
from .json_grammar import KINDS, JsonValue

PARAMETER_CLOSE = b"</parameter>"
# What ends a value for the parser: text values may not hold them (the first one closes the value).
VALUE_ENDS = (PARAMETER_CLOSE, b"</function>", b"</tool_call>")
XML_CALL_CLOSE = b"</function>\n</tool_call>"
XML_NEXT_CALL = b"\n<tool_call>\n<function="
JSON_NAME_END = b'", "arguments": '
JSON_CALL_CLOSE = b"}\n</tool_call>"
JSON_NEXT_CALL = b'\n<tool_call>\n{"name": "'
_UNSAFE_NAME_BYTES = frozenset(b'<>\n"\\')
_TEXT_LOOP = frozenset(range(256)) - {ord("<")}


def _safe(name: str) -> bool:
    return bool(name) and not _UNSAFE_NAME_BYTES & set(name.encode())


@lru_cache(maxsize=4096)
def _value_match(match: bytes, byte: int) -> bytes | None:
    """Inside a text value: the longest suffix of `match + byte` that may start a value-ending tag;
    PARAMETER_CLOSE itself when it is complete; None for another tag (the parser would cut the value)."""
    text = match + bytes((byte,))
    if text == PARAMETER_CLOSE:
        return text
    if text in VALUE_ENDS:
        return None
    for start in range(len(text)):
        suffix = text[start:]
        if any(end.startswith(suffix) for end in VALUE_ENDS):
            return suffix
    return b""


def json_kinds(schema: Mapping[str, Any] | None) -> frozenset[str] | None:
    """The JSON kinds a parameter's schema allows when it admits no string (None: a text value)."""
    declared = (schema or {}).get("type")
    types = {declared} if isinstance(declared, str) else set(declared or ())
    if not types or "string" in types or not types <= set(KINDS):
        return None
    return frozenset(types)


class XmlToolCall(Grammar):
    def __init__(self, tools: Mapping[str, Mapping[str, Any]], name: str | None, parallel: bool) -> None:
        """`tools`: each tool's parameters schema; `name`: the forced tool (None: any of them);
        `parallel`: more calls may follow the first."""
        self.properties: dict[str, dict[str, Any]] = {}
        self.required: dict[str, frozenset[str]] = {}
        for tool, schema in tools.items():
            properties = {k: v for k, v in (schema.get("properties") or {}).items() if _safe(k)}
            self.properties[tool] = properties
            self.required[tool] = frozenset(schema.get("required") or ()) & set(properties)
        self.name = name
        self.key = ("xml-tool-call", json.dumps(tools, sort_keys=True), name, parallel)
        self._next = Choice([XML_NEXT_CALL] if parallel else [])
        self._names = Choice([t.encode() + b">\n" for t in tools if _safe(t)])
        self._bodies: dict[tuple[str, tuple[str, ...], bool], Choice] = {}
        self._values: dict[tuple[str, str], JsonValue | None] = {}
        self._end = Choice([b"\n" + PARAMETER_CLOSE])

    def start(self) -> State:
        return ("name", b"") if self.name is None else ("body", self.name, (), True, b"")

    def accepts(self, state: State) -> bool:
        return state == ("after", b"")

    def loop_bytes(self, state: State) -> frozenset[int]:
        kind = state[0]
        if kind == "text" and not state[3]:
            return _TEXT_LOOP
        if kind == "json":
            grammar = self._value(state[1], state[3])
            assert grammar is not None
            return grammar.loop_bytes(state[4])
        return frozenset()

    def step(self, state: State, byte: int) -> State | None:
        kind = state[0]
        if kind == "after":
            prefix = self._next.step(state[1], byte)
            if prefix is None:
                return None
            return ("name", b"") if self._next.complete(prefix) else ("after", prefix)
        if kind == "name":
            prefix = self._names.step(state[1], byte)
            if prefix is None:
                return None
            if self._names.complete(prefix):
                return ("body", prefix[:-2].decode(), (), True, b"")
            return ("name", prefix)
        if kind == "body":
            _, tool, used, first, prefix = state
            choice = self._body(tool, used, first)
            prefix = choice.step(prefix, byte)
            if prefix is None:
                return None
            if not choice.complete(prefix):
                return ("body", tool, used, first, prefix)
            if prefix.endswith(XML_CALL_CLOSE):
                return ("after", b"")
            key = prefix.removeprefix(b"\n").removeprefix(b"<parameter=")[:-2].decode()
            used = tuple(sorted((*used, key)))
            grammar = self._value(tool, key)
            if grammar is None:
                return ("text", tool, used, b"")
            return ("json", tool, used, key, grammar.start())
        if kind == "text":
            _, tool, used, match = state
            match = _value_match(match, byte)
            if match is None:
                return None
            return (
                ("body", tool, used, False, b"") if match == PARAMETER_CLOSE else ("text", tool, used, match)
            )
        if kind == "json":
            _, tool, used, key, inner = state
            grammar = self._value(tool, key)
            assert grammar is not None
            after = grammar.step(inner, byte)
            if after is not None:
                return ("json", tool, used, key, after)
            if not grammar.accepts(inner):
                return None
            return self.step(("end", tool, used, b""), byte)
        _, tool, used, prefix = state  # "end": the newline and tag after a JSON value
        prefix = self._end.step(prefix, byte)
        if prefix is None:
            return None
        return ("body", tool, used, False, b"") if self._end.complete(prefix) else ("end", tool, used, prefix)

    def _body(self, tool: str, used: tuple[str, ...], first: bool) -> Choice:
        choice = self._bodies.get((tool, used, first))
        if choice is None:
            lead = b"" if first else b"\n"
            options = [
                lead + b"<parameter=" + k.encode() + b">\n" for k in self.properties[tool] if k not in used
            ]
            if self.required[tool] <= set(used):
                options.append(lead + XML_CALL_CLOSE)
            choice = self._bodies[(tool, used, first)] = Choice(options)
        return choice

    def _value(self, tool: str, key: str) -> JsonValue | None:
        if (tool, key) not in self._values:
            kinds = json_kinds(self.properties[tool].get(key))
            self._values[(tool, key)] = None if kinds is None else JsonValue(kinds, leading_whitespace=False)
        return self._values[(tool, key)]


class JsonToolCall(Grammar):
    def __init__(self, tools: Mapping[str, Mapping[str, Any]], name: str | None, parallel: bool) -> None:
        self.name = name
        self.key = ("json-tool-call", tuple(sorted(tools)), name, parallel)
        self._next = Choice([JSON_NEXT_CALL] if parallel else [])
        self._names = Choice([t.encode() + JSON_NAME_END for t in tools if _safe(t)])
        self._arguments = JsonValue(frozenset({"object"}), leading_whitespace=False)
        self._close = Choice([JSON_CALL_CLOSE])

    def start(self) -> State:
        return ("name", b"") if self.name is None else ("arguments", self._arguments.start())

    def accepts(self, state: State) -> bool:
        return state == ("after", b"")

    def loop_bytes(self, state: State) -> frozenset[int]:
        return self._arguments.loop_bytes(state[1]) if state[0] == "arguments" else frozenset()

    def step(self, state: State, byte: int) -> State | None:
        kind, inner = state[0], state[-1]
        if kind == "after":
            prefix = self._next.step(inner, byte)
            if prefix is None:
                return None
            return ("name", b"") if self._next.complete(prefix) else ("after", prefix)
        if kind == "name":
            prefix = self._names.step(inner, byte)
            if prefix is None:
                return None
            return (
                ("arguments", self._arguments.start()) if self._names.complete(prefix) else ("name", prefix)
            )
        if kind == "arguments":
            after = self._arguments.step(inner, byte)
            if after is not None:
                return ("arguments", after)
            return self.step(("close", b""), byte) if self._arguments.accepts(inner) else None
        prefix = self._close.step(inner, byte)
        if prefix is None:
            return None
        return ("after", b"") if self._close.complete(prefix) else ("close", prefix)

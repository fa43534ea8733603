"""Tool calls in the model's output, parsed as they stream: the Qwen3.5/3.6 XML form and the older JSON form.

XML (what Qwen3.5/3.6 templates emit, vLLM's "qwen3_coder"):
    <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>
JSON (older Qwen templates, "hermes"):
    <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>

A call is only taken once its header is complete and names a declared tool; anything else (a literal
`<tool_call>` in prose, inline code or a fenced code block, a malformed header) goes out as plain text, so a
stream never stalls on it. XML arguments are typed by the tool's JSON schema and streamed as JSON fragments
(string values as they arrive, other values when complete); JSON-form arguments stream as they arrive,
through an incremental JSON recognizer. A call cut off by the end of the stream, or whose JSON breaks off,
keeps what arrived (its fragments completed so that they parse).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from onestream.worker.constraints.json_grammar import AFTER, OBJECT_KEY, VALUE, JsonValue

from .events import Event, Text, ToolCallArguments, ToolCallBegin, ToolCallEnd

XML = "xml"
JSON = "json"
OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
VALUE_ENDS = (PARAMETER_CLOSE, FUNCTION_CLOSE, CLOSE)
JSON_HEAD = '{"name":"'  # how a JSON-form call opens, less whitespace
CODE_FENCE = "```"
MAX_NAME_CHARS = 256
MAX_JSON_CALL_CHARS = 1 << 20  # a JSON-form call longer than this is not one: let the text out
_NAME = re.compile(r"[A-Za-z0-9_.:\-]*")
# A JSON-form call whose arguments can stream: the name first, then the arguments object.
_JSON_STREAM_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


def partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def typed_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """An XML parameter's text as the type its JSON schema declares; the text itself when it is a string,
    undeclared, or does not parse as the declared type."""
    if schema is None:
        return raw
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    if "string" in types:
        return raw
    text = raw.strip()
    for kind in types or ["any"]:
        try:
            value = json.loads(text)
        except ValueError:
            if kind == "boolean" and text.lower() in ("true", "false"):
                return text.lower() == "true"
            if kind == "null" and text.lower() in ("none", "null"):
                return None
            continue
        if _is_kind(value, kind):
            return value
    return raw


def _is_kind(value: Any, kind: str) -> bool:
    checks: dict[str, Callable[[Any], bool]] = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "null": lambda v: v is None,
        "any": lambda v: True,
    }
    return checks.get(kind, checks["any"])(value)


def _streams_as_string(schema: Mapping[str, Any] | None) -> bool:
    if schema is None:
        return True
    declared = schema.get("type")
    return declared == "string" or (isinstance(declared, list) and "string" in declared)


class ToolCallParser:
    """Feed text deltas, get events; `finish()` at the end of the stream flushes what is held."""

    def __init__(
        self, tools: Mapping[str, Mapping[str, Any]], formats: tuple[str, ...] = (XML, JSON)
    ) -> None:
        """`tools`: each declared tool's name and its parameters' JSON schema ({} when it has none)."""
        self.tools = {name: dict(schema.get("properties") or {}) for name, schema in tools.items()}
        self.formats = formats
        self._buffer = ""
        self._state = self._text
        self._content = ""  # text emitted so far: whether a code fence is open
        self._calls = 0
        self._after_call = False
        self._call: dict[str, Any] = {}
        self._parameter: str | None = None
        self._value = ""
        self._value_started = False
        self._arguments_grammar = JsonValue(frozenset({"object"}), leading_whitespace=False)
        self._arguments_state: Any = None
        self._arguments_text = ""
        self._held = ""

    @property
    def calls(self) -> int:
        return self._calls

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    def _run(self, *, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._state(out, final):
            pass
        return out

    # ---- plain text ----------------------------------------------------------------------------
    def _text(self, out: list[Event], final: bool) -> bool:
        start = 0
        while (found := self._buffer.find(OPEN, start)) >= 0 and not self._opens_call(found):
            start = found + 1
        if found >= 0:
            self._emit_text(out, self._buffer[:found])
            self._buffer = self._buffer[found + len(OPEN) :]
            self._state = self._header
            return True
        keep = 0 if final else partial_suffix(self._buffer, [OPEN])
        self._emit_text(out, self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _opens_call(self, at: int) -> bool:
        before = self._content + self._buffer[:at]
        return not before.endswith("`") and before.count(CODE_FENCE) % 2 == 0

    def _emit_text(self, out: list[Event], text: str) -> None:
        if self._after_call:  # whitespace between and after calls is not an answer
            text = text.lstrip()
            self._after_call = not text
        if text:
            self._content += text
            out.append(Text(text))

    def _literal(self, out: list[Event]) -> bool:
        """What followed `<tool_call>` is no call: the tag is text, and the rest is read as text again."""
        self._emit_text(out, OPEN)
        self._state = self._text
        return True

    # ---- a call's header -----------------------------------------------------------------------
    def _header(self, out: list[Event], final: bool) -> bool:
        head = self._buffer.lstrip()
        if XML in self.formats and head.startswith(FUNCTION_OPEN):
            end = head.find(">", len(FUNCTION_OPEN))
            name = head[len(FUNCTION_OPEN) : end if end >= 0 else None]
            if end < 0:
                if not final and self._could_name(name):
                    return False
                return self._literal(out)
            if name not in self.tools:
                return self._literal(out)
            self._buffer = head[end + 1 :]
            self._begin(out, name)
            self._state = self._body
            return True
        if JSON in self.formats and head.startswith("{"):
            return self._json_header(out, head, final)
        if not final and (not head or (XML in self.formats and FUNCTION_OPEN.startswith(head))):
            return False
        return self._literal(out)

    def _json_header(self, out: list[Event], head: str, final: bool) -> bool:
        """A JSON-form call must open with `{"name": "<a declared tool>"`; anything else is text at once."""
        compact = re.sub(r"\s+", "", head)
        if compact.startswith(JSON_HEAD):
            rest = compact[len(JSON_HEAD) :]
            end = rest.find('"')
            if end >= 0 and rest[:end] in self.tools:
                self._state = self._json
                return True
            if end < 0 and not final and self._could_name(rest):
                return False
        elif not final and JSON_HEAD.startswith(compact):
            return False
        return self._literal(out)

    def _could_name(self, prefix: str) -> bool:
        return any(name.startswith(prefix) for name in self.tools) and bool(_NAME.fullmatch(prefix))

    def _begin(self, out: list[Event], name: str) -> None:
        self._call = {"index": self._calls, "name": name, "arguments": {}, "opened": False}
        self._calls += 1
        out.append(ToolCallBegin(self._call["index"], name))

    def _end(self, out: list[Event]) -> None:
        index, arguments = self._call["index"], self._call["arguments"]
        out.append(ToolCallArguments(index, "}" if self._call["opened"] else "{}"))
        out.append(ToolCallEnd(index, arguments))
        self._after_call = True

    # ---- the XML form's body -------------------------------------------------------------------
    def _body(self, out: list[Event], final: bool) -> bool:
        body = self._buffer.lstrip()
        if body.startswith(PARAMETER_OPEN):
            end = body.find(">", len(PARAMETER_OPEN))
            if end >= 0:
                self._buffer = body[end + 1 :]
                self._begin_parameter(out, body[len(PARAMETER_OPEN) : end])
                self._state = self._parameter_value
                return True
            if not final and len(body) <= len(PARAMETER_OPEN) + MAX_NAME_CHARS:
                return False
        for closer, then in ((FUNCTION_CLOSE, self._after_function), (CLOSE, self._text)):
            if body.startswith(closer):
                self._buffer = body[len(closer) :]
                self._end(out)
                self._state = then
                return True
        if any(m.startswith(body) for m in (PARAMETER_OPEN, FUNCTION_CLOSE, CLOSE)) or (
            final and body.startswith(PARAMETER_OPEN)
        ):
            if not final:
                return False
            body = ""  # the output ended inside a tag of the call (max_tokens): the tag is not text
        self._buffer = body  # a malformed body ends the call; what follows is text
        self._end(out)
        self._state = self._text
        return True

    def _begin_parameter(self, out: list[Event], name: str) -> None:
        schema = self.tools[self._call["name"]].get(name)
        self._parameter, self._value, self._value_started = name, "", False
        self._parameter_streams = _streams_as_string(schema)
        lead = ", " if self._call["opened"] else "{"
        self._call["opened"] = True
        fragment = f"{lead}{json.dumps(name, ensure_ascii=False)}: " + (
            '"' if self._parameter_streams else ""
        )
        out.append(ToolCallArguments(self._call["index"], fragment))

    def _parameter_value(self, out: list[Event], final: bool) -> bool:
        ends = [(at, marker) for marker in VALUE_ENDS if (at := self._buffer.find(marker)) >= 0]
        at, marker = min(ends) if ends else (-1, "")
        done = at >= 0 or final
        if at >= 0:
            cut = at
        else:
            # At the end of the output too: a value cut off inside its closing tag (max_tokens) ends before it.
            cut = len(self._buffer) - partial_suffix(self._buffer, VALUE_ENDS)
            if (not final or cut < len(self._buffer)) and self._buffer[:cut].endswith("\n"):
                cut -= 1  # the newline before a closing tag is not part of the value
        chunk, self._buffer = self._buffer[:cut], self._buffer[cut:]
        if final and at < 0:
            self._buffer = ""
        if not self._value_started:
            if not chunk and not done:
                return False
            chunk = chunk.removeprefix("\n")
            self._value_started = True
        if done:
            chunk = chunk.removesuffix("\n")
        self._value += chunk
        if self._parameter_streams and chunk:
            out.append(ToolCallArguments(self._call["index"], json.dumps(chunk, ensure_ascii=False)[1:-1]))
        if not done:
            return False
        self._finish_parameter(out)
        if marker == PARAMETER_CLOSE:
            self._buffer = self._buffer[len(PARAMETER_CLOSE) :]
        self._state = self._body
        return True

    def _finish_parameter(self, out: list[Event]) -> None:
        assert self._parameter is not None
        schema = self.tools[self._call["name"]].get(self._parameter)
        value = typed_value(self._value, schema)
        self._call["arguments"][self._parameter] = value
        fragment = '"' if self._parameter_streams else json.dumps(value, ensure_ascii=False)
        out.append(ToolCallArguments(self._call["index"], fragment))
        self._parameter = None

    def _after_function(self, out: list[Event], final: bool) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith(CLOSE):
            self._buffer = rest[len(CLOSE) :]
        elif CLOSE.startswith(rest):
            if not final:
                return False
            self._buffer = ""  # the output ended inside the closing tag
        self._state = self._text
        return True

    # ---- the JSON form -------------------------------------------------------------------------
    def _json(self, out: list[Event], final: bool) -> bool:
        """`{"name": NAME, "arguments": {` streams its arguments as they arrive; any other shape of a
        JSON-form call (arguments first, as a string) is read whole at `</tool_call>`."""
        head = _JSON_STREAM_HEAD.match(self._buffer)
        if head is not None and head.group("name") in self.tools:
            self._buffer = self._buffer[head.end() :]
            self._begin(out, head.group("name"))
            self._arguments_state = self._arguments_grammar.start()
            self._arguments_text = ""
            self._held = ""
            self._state = self._json_arguments
            return True
        compact = re.sub(r"\s+", "", self._buffer)
        heads = [
            f'{{"name":"{name}","{key}":{{' for name in self.tools for key in ("arguments", "parameters")
        ]
        if not final and any(h.startswith(compact) for h in heads):
            return False  # the head is not complete yet
        return self._json_whole(out, final)

    def _json_arguments(self, out: list[Event], final: bool) -> bool:
        """Feed the arguments object through the JSON recognizer: what it takes streams out (but a trailing
        comma, held until a member follows it); the end of the object, a character it refuses, or the end
        of the stream ends the call, completed so that its fragments still parse (the XML form keeps what
        arrived the same way)."""
        grammar, state = self._arguments_grammar, self._arguments_state
        taken = 0
        for char in self._buffer:
            after = grammar.advance(state, char.encode())
            if after is None:
                break
            state, taken = after, taken + 1
            if grammar.accepts(state):
                break
        pending, self._buffer = self._held + self._buffer[:taken], self._buffer[taken:]
        self._arguments_state = state
        stripped = pending.rstrip()
        after_comma = state[0] in (OBJECT_KEY, VALUE) and stripped.endswith(",")
        complete = grammar.accepts(state)
        if not (complete or self._buffer or final):
            self._held = pending[len(stripped) - 1 :] if after_comma else ""
            self._stream_arguments(out, pending[: len(stripped) - 1] if after_comma else pending)
            return False
        if complete:
            closing = ""
        elif after_comma:  # the comma goes: the members before it are the arguments
            pending, closing = stripped[:-1], grammar.completion((AFTER, state[1], 0))
        else:
            closing = grammar.completion(state)
        self._stream_arguments(out, pending + closing)
        arguments = json.loads(self._arguments_text)
        self._call["arguments"] = arguments
        out.append(ToolCallEnd(self._call["index"], arguments))
        self._after_call = True
        self._state = self._json_tail
        return True

    def _stream_arguments(self, out: list[Event], fragment: str) -> None:
        if fragment:
            self._arguments_text += fragment
            out.append(ToolCallArguments(self._call["index"], fragment))

    def _json_tail(self, out: list[Event], final: bool) -> bool:
        """After the arguments: the call object's `}` and `</tool_call>`, dropped; anything else is text."""
        rest = self._buffer.lstrip()
        rest = rest[1:].lstrip() if rest.startswith("}") else rest
        if rest.startswith(CLOSE):
            rest = rest[len(CLOSE) :]
        elif not final and CLOSE.startswith(rest):
            return False  # `</tool_call>` may be on its way
        self._buffer = rest
        self._state = self._text
        return True

    def _json_whole(self, out: list[Event], final: bool) -> bool:
        end = self._buffer.find(CLOSE)
        if end < 0 and not final and len(self._buffer) <= MAX_JSON_CALL_CHARS:
            return False
        body = self._buffer if end < 0 else self._buffer[:end]
        call = self._json_call(body)
        if call is None:
            self._emit_text(out, OPEN)
            self._state = self._text
            return True
        self._buffer = "" if end < 0 else self._buffer[end + len(CLOSE) :]
        name, arguments = call
        self._begin(out, name)
        self._call["arguments"] = arguments
        text = json.dumps(arguments, ensure_ascii=False)
        out.append(ToolCallArguments(self._call["index"], text))
        out.append(ToolCallEnd(self._call["index"], arguments))
        self._after_call = True
        self._state = self._text
        return True

    def _json_call(self, body: str) -> tuple[str, dict[str, Any]] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.tools:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        return (value["name"], arguments) if isinstance(arguments, dict) else None

"""The model's output split into reasoning and answer, as it streams, with the answer's tool calls parsed.

Qwen3.5/3.6 templates put `<think>` into the prompt, so the model only generates `</think>`; a `<tool_call>`
also ends the reasoning (a call made while thinking is still a call). A model whose template does not
open the block may open it itself: output that starts with `<think>` is reasoning too.
"""

from __future__ import annotations

from .events import Event, Reasoning, Text
from .toolcalls import OPEN, ToolCallParser, partial_suffix

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside a reasoning block (the template opened it)."""
    return prompt.rstrip().endswith(THINK_OPEN)


class OutputParser:
    """Feed text deltas, get reasoning, text and tool-call events; `finish()` at the end of the stream."""

    def __init__(self, *, reasoning: bool, tools: ToolCallParser | None) -> None:
        self._tools = tools
        self._buffer = ""
        self._state = self._reasoning if reasoning else self._start
        self._strip_newlines = False  # the blank line after `</think>` is not part of the answer
        self._drop_close = False  # reasoning ended by a tool call: a later `</think>` is not text

    @property
    def tool_calls(self) -> int:
        return self._tools.calls if self._tools is not None else 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        out = self._run(final=True)
        if self._tools is not None:
            out.extend(self._tools.finish())
        return out

    def _run(self, *, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._state(out, final):
            pass
        return out

    def _start(self, out: list[Event], final: bool) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(THINK_OPEN):
            self._buffer = head[len(THINK_OPEN) :]
            self._state = self._reasoning
            return True
        if not final and THINK_OPEN.startswith(head):
            return False
        self._state = self._answer
        return True

    def _reasoning(self, out: list[Event], final: bool) -> bool:
        ends = [(at, m) for m in (THINK_CLOSE, OPEN) if (at := self._buffer.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            if at:
                out.append(Reasoning(self._buffer[:at]))
            if marker == THINK_CLOSE:
                self._buffer = self._buffer[at + len(THINK_CLOSE) :]
                self._strip_newlines = True
            else:
                self._buffer = self._buffer[at:]
                self._drop_close = True
            self._state = self._answer
            return True
        keep = 0 if final else partial_suffix(self._buffer, (THINK_CLOSE, OPEN))
        if len(self._buffer) > keep:
            out.append(Reasoning(self._buffer[: len(self._buffer) - keep]))
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _answer(self, out: list[Event], final: bool) -> bool:
        if self._strip_newlines:
            self._buffer = self._buffer.lstrip("\n")
            if not self._buffer and not final:
                return False
            self._strip_newlines = False
        text, self._buffer = self._buffer, ""
        if self._drop_close:
            text, self._buffer = self._without_close(text, final)
        if text:
            out.extend(self._tools.feed(text) if self._tools is not None else [Text(text)])
        return False

    def _without_close(self, text: str, final: bool) -> tuple[str, str]:
        """`text` less its first `</think>`, and what to hold back until it is known not to start one."""
        at = text.find(THINK_CLOSE)
        if at >= 0:
            self._drop_close = False
            return text[:at] + text[at + len(THINK_CLOSE) :], ""
        keep = 0 if final else partial_suffix(text, (THINK_CLOSE,))
        return text[: len(text) - keep], text[len(text) - keep :]

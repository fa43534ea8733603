"""What the model's output is split into: answer text, reasoning, and tool calls (streamed in pieces)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCallBegin:
    index: int  # 0, 1, ... in the order the model emitted them
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """A fragment of the call's arguments as JSON text; a call's fragments concatenated parse as its
    arguments object."""

    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    arguments: dict[str, Any]


Event = Text | Reasoning | ToolCallBegin | ToolCallArguments | ToolCallEnd


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class Collected:
    """A whole turn's output, for the non-streaming answers."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Text):
                self.text += event.text
            elif isinstance(event, Reasoning):
                self.reasoning += event.text
            elif isinstance(event, ToolCallEnd):
                self.tool_calls.append(ToolCall(self._names[event.index], event.arguments))
            elif isinstance(event, ToolCallBegin):
                self._names[event.index] = event.name

    def __post_init__(self) -> None:
        self._names: dict[int, str] = {}

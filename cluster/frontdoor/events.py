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


@dataclass
class Block:
    """One piece of a turn's output as Anthropic's content blocks and the Responses API's output items
    see it: a run of reasoning, a run of text, or one tool call."""

    kind: str  # "reasoning" | "text" | "tool"
    index: int  # position among the turn's blocks
    name: str = ""  # a tool's
    text: str = ""  # the reasoning or text so far; a tool's arguments as JSON so far
    arguments: dict[str, Any] | None = None  # a tool's, once complete


@dataclass(frozen=True)
class Step:
    action: str  # "open" | "delta" | "close"
    block: Block
    delta: str = ""


class Blocks:
    """Groups events into blocks, saying when each opens, grows and closes; `max_calls` drops the calls
    past it (a client that asked for one call per turn)."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.blocks: list[Block] = []
        self._current: Block | None = None
        self._max_calls = max_calls

    def feed(self, events: list[Event]) -> list[Step]:
        steps: list[Step] = []
        for event in events:
            if isinstance(event, (Text, Reasoning)):
                kind = "text" if isinstance(event, Text) else "reasoning"
                if self._current is None or self._current.kind != kind:
                    self._open(steps, Block(kind, len(self.blocks)))
                self._grow(steps, event.text)
            elif self._max_calls is not None and event.index >= self._max_calls:
                continue
            elif isinstance(event, ToolCallBegin):
                self._open(steps, Block("tool", len(self.blocks), name=event.name))
            elif isinstance(event, ToolCallArguments):
                self._grow(steps, event.fragment)
            elif isinstance(event, ToolCallEnd) and self._current is not None:
                self._current.arguments = event.arguments
                steps += self.close()
        return steps

    def close(self) -> list[Step]:
        if self._current is None:
            return []
        block, self._current = self._current, None
        return [Step("close", block)]

    @property
    def tool_calls(self) -> list[Block]:
        return [block for block in self.blocks if block.kind == "tool"]

    def _open(self, steps: list[Step], block: Block) -> None:
        steps += self.close()
        self.blocks.append(block)
        self._current = block
        steps.append(Step("open", block))

    def _grow(self, steps: list[Step], text: str) -> None:
        assert self._current is not None
        self._current.text += text
        steps.append(Step("delta", self._current, text))

"""Prompts rendered by the checkpoint's own chat template (with tools and template kwargs, as vLLM does),
tokenised here so that the router can route and cache by tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.worker.constraints import JSON_OBJECT, TOOL_CALL
from onestream.worker.errors import InvalidRequestError
from onestream.worker.tokenizer import Tokenizer

from .errors import bad_field
from .reasoning import THINK_CLOSE, OutputParser, prompt_opens_reasoning
from .toolcalls import JSON, OPEN, XML, ToolCallParser

REQUIRED = object()  # tool_choice "required": some call, the model names it
_PROBE = "onestream_probe_tool"
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})


@dataclass(frozen=True)
class Tool:
    """A client's tool as the model sees it. `custom`: a freeform tool (the Responses API's `custom`, Codex's
    apply_patch), shown as a function of one string parameter (CUSTOM_INPUT) whose value is the call's
    input text; `namespace`: the group a Responses `namespace` tool put it in (`name` then joins the two,
    `call_name` is the client's own)."""

    name: str
    description: str
    parameters: dict[str, Any]
    custom: bool = False
    namespace: str = ""
    call_name: str = ""

    @property
    def client_name(self) -> str:
        return self.call_name or self.name

    def for_template(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass
class Prompt:
    text: str
    token_ids: list[int]
    reasoning: bool  # the template opened a reasoning block: the output starts inside it
    # The start of the answer written into the prompt (a forced tool call, or the final assistant message a
    # client asked to continue): the output parser reads it first.
    prefill: str
    tools: Sequence[Tool]
    # What the output must match (a forced call's rest, a JSON answer): the card masks its tokens.
    constraint: pb.OutputConstraint | None = None


class ChatTemplate:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tool_format = self._tool_format()

    def _tool_format(self) -> str | None:
        """The tool-call form the template writes for an assistant's call: XML, JSON, or None (no tools)."""
        call = {"type": "function", "function": {"name": _PROBE, "arguments": {"x": "1"}}}
        messages = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        tool = Tool(_PROBE, "probe", {"type": "object", "properties": {"x": {"type": "string"}}})
        try:
            text = self.tokenizer.render_chat(
                messages, add_generation_prompt=False, tools=[tool.for_template()]
            )
        except InvalidRequestError:
            return None
        if f"<function={_PROBE}>" in text:
            return XML
        if OPEN in text and f'"{_PROBE}"' in text:
            return JSON
        return None

    async def render(
        self,
        messages: list[dict[str, Any]],
        tools: Sequence[Tool],
        template_kwargs: Mapping[str, Any],
        forced: str | object | None = None,
        *,
        continue_final: bool = False,
        json_answer: bool = False,
        parallel_calls: bool = True,
        memo_scope: str | None = None,
    ) -> Prompt:
        """The prompt of a chat turn; `forced` (a tool name or REQUIRED) starts the answer with a call,
        which the card's constrained decoding completes; `continue_final`: a final assistant message is the
        start of the answer, which the model continues; `json_answer`: the answer is one JSON object
        (reasoning, if the template opened it, is closed first: the constraint holds from the first token);
        `parallel_calls`: a forced call may be followed by more; `memo_scope`: the caller's scope for the
        tokenizer's remembered segments (Service.memo_scope)."""
        if tools and self.tool_format is None:
            raise bad_field("tools", "this model's chat template does not render tools")
        for key in RESERVED_KWARGS & set(template_kwargs):
            raise bad_field(f"chat_template_kwargs.{key}", "is the request's own; set it there")
        start = ""
        if continue_final and len(messages) > 1 and messages[-1]["role"] == "assistant":
            if messages[-1].get("tool_calls"):
                raise bad_field("messages", "a final assistant message to continue cannot hold tool calls")
            start, messages = messages[-1]["content"], messages[:-1]
        if forced is not None and start:
            raise bad_field("tool_choice", "a forced tool call cannot follow a final assistant message")
        if json_answer and (forced is not None or start):
            what = "a forced tool call" if forced is not None else "a final assistant message to continue"
            raise bad_field("response_format", f"a JSON answer cannot be combined with {what}")
        prompt = await asyncio.to_thread(
            self._render, messages, tools, dict(template_kwargs), forced, memo_scope
        )
        if prompt.constraint is not None:
            prompt.constraint.parallel_calls = parallel_calls
        if json_answer:
            if prompt.reasoning:
                prompt.text += f"{THINK_CLOSE}\n\n"
                prompt.prefill += f"{THINK_CLOSE}\n\n"
                prompt.token_ids = self.tokenizer.encode(prompt.text, memo_scope=memo_scope)
            prompt.constraint = pb.OutputConstraint(kind=JSON_OBJECT)
        prompt.text += start
        prompt.prefill += start
        if start:
            prompt.token_ids = self.tokenizer.encode(prompt.text, memo_scope=memo_scope)
        return prompt

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: Sequence[Tool],
        template_kwargs: dict[str, Any],
        forced: str | object | None,
        memo_scope: str | None,
    ) -> Prompt:
        kwargs = dict(template_kwargs)
        if tools:
            kwargs["tools"] = [tool.for_template() for tool in tools]
        try:
            text = self.tokenizer.render_chat(messages, **kwargs)
        except InvalidRequestError as e:
            late_system = [i for i, m in enumerate(messages) if m["role"] == "system" and i > 0]
            if not late_system:
                raise bad_field("messages", str(e).removeprefix("messages: ")) from e
            # Stock Qwen templates refuse a system message after the first (Claude Code sends one): such
            # messages go in as user turns rather than the request failing.
            moved = [dict(m, role="user") if i in late_system else m for i, m in enumerate(messages)]
            try:
                text = self.tokenizer.render_chat(moved, **kwargs)
            except InvalidRequestError as again:
                raise bad_field("messages", str(again).removeprefix("messages: ")) from again
        reasoning = prompt_opens_reasoning(text)
        prefill = self._prefill(forced, reasoning)
        text += prefill
        prompt = Prompt(text, self.tokenizer.encode(text, memo_scope=memo_scope), reasoning, prefill, tools)
        if forced is not None:
            prompt.constraint = self._tool_constraint(tools, forced)
        return prompt

    def _tool_constraint(self, tools: Sequence[Tool], forced: str | object) -> pb.OutputConstraint:
        """The rest of the call `_prefill` opened: the tool's name (unless named), its arguments, its close."""
        return pb.OutputConstraint(
            kind=TOOL_CALL,
            tool_format=self.tool_format or "",
            tools=[pb.ConstrainedTool(name=t.name, parameters=json.dumps(t.parameters)) for t in tools],
            tool_name=forced if isinstance(forced, str) else "",
        )

    def _prefill(self, forced: str | object | None, reasoning: bool) -> str:
        if forced is None:
            return ""
        close = f"{THINK_CLOSE}\n\n" if reasoning else ""
        named = isinstance(forced, str)
        if self.tool_format == XML:
            return close + f"{OPEN}\n<function=" + (f"{forced}>\n" if named else "")
        return close + f'{OPEN}\n{{"name": "' + (f'{forced}", "arguments": ' if named else "")

    def parser(self, prompt: Prompt, *, parse_tools: bool) -> OutputParser:
        """The parser of this turn's output, already fed the prefill (call `prefill_events` once)."""
        formats = (self.tool_format,) if self.tool_format else (XML, JSON)
        tools = {tool.name: tool.parameters for tool in prompt.tools}
        calls = ToolCallParser(tools, formats) if parse_tools and tools else None
        return OutputParser(reasoning=prompt.reasoning, tools=calls)

    async def count(self, text: str) -> int:
        return len(await asyncio.to_thread(self.tokenizer.encode, text))

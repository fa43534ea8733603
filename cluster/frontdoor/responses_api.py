"""The Responses API, the subset Codex CLI uses: input items (messages, function and custom tool calls and
their outputs, reasoning), function, custom and namespace tools, and the streaming events. Nothing is
stored: every request carries the whole conversation (Codex sends `store: false`); `prompt_cache_key` keeps
a conversation on its card."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from aiohttp import web

from . import params, sse
from .errors import ApiError, bad_field, responses_context_error
from .events import Block, Blocks, Step
from .openai_api import (
    add_tool,
    arguments_object,
    function_tool,
    json_format,
    template_call,
    text_content,
    thinking_switch,
    tool_choice,
)
from .service import Generation, Service, TurnSpec, new_id
from .template import Tool

log = logging.getLogger(__name__)
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
CUSTOM_INPUT = "input"  # the one parameter a custom tool is shown with: its input text
CALL_KINDS = ("function", "custom")
_skipped_logged: set[str] = set()


# ---- tools --------------------------------------------------------------------------------------------
def declared_tools(raw: Any) -> list[Tool]:
    """The tools the model can call: functions, custom (freeform) tools and the members of namespaces.
    Tools the server would run itself (web_search, local_shell, file_search, ...) cannot run here: they are
    left out, logged, rather than the request refused (Codex declares web_search in every request)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_field("tools", "must be an array of tools")
    tools: dict[str, Tool] = {}
    skipped: list[str] = []
    for i, tool in enumerate(raw):
        path = f"tools[{i}]."
        if not isinstance(tool, dict):
            raise bad_field(f"tools[{i}]", f"must be an object, got {type(tool).__name__}")
        kind = tool.get("type")
        if kind == "namespace":
            for member in _namespace_tools(tool, path, skipped):
                add_tool(tools, member, path)
        elif kind in CALL_KINDS:
            add_tool(tools, _call_tool(tool, path), path)
        else:
            skipped.append(str(kind))
    _log_skipped(skipped)
    return list(tools.values())


def _call_tool(spec: dict[str, Any], where: str) -> Tool:
    if spec.get("type") == "function":
        return function_tool(spec, where)
    name = params.get(spec, "name", str, path=where, required=True)
    text = {"type": "string", "description": _input_description(params.get(spec, "format", dict, path=where))}
    schema = {"type": "object", "properties": {CUSTOM_INPUT: text}, "required": [CUSTOM_INPUT]}
    return Tool(name, params.get(spec, "description", str, path=where) or "", schema, custom=True)


def _input_description(format_: dict[str, Any] | None) -> str:
    """What a custom tool's input must be: its grammar where it gives one (apply_patch's Lark grammar)."""
    spec = format_ or {}
    definition = spec.get("definition")
    if spec.get("type") == "grammar" and isinstance(definition, str):
        return f"The input as raw text, in this {spec.get('syntax') or 'given'} grammar:\n{definition}"
    return "The input as raw text."


def _namespace_tools(spec: dict[str, Any], path: str, skipped: list[str]) -> list[Tool]:
    """A namespace's function and custom tools, each named `namespace` + `name` for the model (Codex's
    MCP tools: mcp__server__ and tool make mcp__server__tool), their calls named back in two fields. The
    namespace's own description (what the server is for) opens each member's, the one place the model reads it."""
    namespace = params.get(spec, "name", str, path=path, required=True)
    about = (params.get(spec, "description", str, path=path) or "").strip()
    members = []
    for j, tool in enumerate(params.get(spec, "tools", list, path=path, required=True)):
        where = f"{path}tools[{j}]."
        if not isinstance(tool, dict):
            raise bad_field(where.rstrip("."), f"must be an object, got {type(tool).__name__}")
        if tool.get("type") not in CALL_KINDS:
            skipped.append(f"{namespace}/{tool.get('type')}")
            continue
        member = _call_tool(tool, where)
        name = namespaced_name(namespace, member.name)
        description = f"{about}\n\n{member.description}".strip() if about else member.description
        members.append(
            replace(member, name=name, description=description, namespace=namespace, call_name=member.name)
        )
    return members


def namespaced_name(namespace: str, name: str) -> str:
    return f"{namespace}{name}" if namespace.endswith("__") else f"{namespace}__{name}"


def _log_skipped(kinds: list[str]) -> None:
    """Once per kind and process: Codex declares the same tools in every request."""
    new = sorted(set(kinds) - _skipped_logged)
    if new:
        _skipped_logged.update(new)
        log.info("responses: tools of type %s cannot run here; left out of the prompt", ", ".join(new))


# ---- input --------------------------------------------------------------------------------------------
def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` as the template's messages."""
    messages: list[dict[str, Any]] = []
    instructions = params.get(body, "instructions", str)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str) and raw:
        return [*messages, {"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_field("input", "must be a non-empty string or a non-empty array of input items")
    reasoning = ""
    for i, item in enumerate(raw):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_field(path, f"must be an object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad_field(f"{path}.role", f"must be one of {list(MESSAGE_ROLES)}, got {role!r}")
            content = text_content(item.get("content"), f"{path}.content")
            message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            messages.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or "tool_calls" not in last:
                last = {"role": "assistant", "content": "", "tool_calls": []}
                messages.append(last)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, ""
            last["tool_calls"].append(_history_call(item, f"{path}."))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = params.get(item, "call_id", str, path=f"{path}.", required=True)
            output = item.get("output", "")
            text = output if isinstance(output, str) else text_content(output, f"{path}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        else:
            raise bad_field(f"{path}.type", f"{kind!r} items are not supported")
    return messages


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its `content` (what this server sends, the model's own words), else its
    `summary` (what OpenAI's models send)."""

    def texts(parts: Any) -> list[str]:
        parts = parts if isinstance(parts, list) else []
        return [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]

    return "".join(texts(item.get("content"))) or "\n\n".join(texts(item.get("summary")))


def _history_call(item: dict[str, Any], path: str) -> dict[str, Any]:
    """An earlier call as the template renders it, under the name the model was shown; a custom tool's
    input becomes its one argument."""
    name = params.get(item, "name", str, path=path, required=True)
    call_id = params.get(item, "call_id", str, path=path, required=True)
    namespace = params.get(item, "namespace", str, path=path)
    if namespace:
        name = namespaced_name(namespace, name)
    if item["type"] == "custom_tool_call":
        arguments = {CUSTOM_INPUT: params.get(item, CUSTOM_INPUT, str, path=path) or ""}
    else:
        arguments = arguments_object(item.get("arguments", "{}"), f"{path}arguments")
    return template_call(call_id, name, arguments)


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    reasoning = params.get(body, "reasoning", dict) or {}
    return thinking_switch(params.get(reasoning, "effort", str, path="reasoning."))


# ---- output -------------------------------------------------------------------------------------------
class _Items:
    """The output items of a turn's blocks: the ids each keeps across its stream events, and which tool
    each call names (a custom tool's call is a custom_tool_call with its input text; a namespace member's
    carries its namespace)."""

    def __init__(self, tools: Mapping[str, Tool]) -> None:
        self.tools = tools
        self._ids: dict[int, tuple[str, str]] = {}

    def tool(self, block: Block) -> Tool | None:
        return self.tools.get(block.name) if block.kind == "tool" else None

    def item(self, block: Block, status: str) -> dict[str, Any]:
        tool = self.tool(block)
        prefix = {"reasoning": "rs_", "text": "msg_"}.get(block.kind) or (
            "ctc_" if tool and tool.custom else "fc_"
        )
        item_id, call_id = self._ids.setdefault(block.index, (new_id(prefix), new_id("call_")))
        if block.kind == "reasoning":
            return {
                "type": "reasoning",
                "id": item_id,
                "summary": [],
                "content": [{"type": "reasoning_text", "text": block.text}],
            }
        if block.kind == "text":
            part = {"type": "output_text", "text": block.text, "annotations": []}
            return {
                "type": "message",
                "id": item_id,
                "status": status,
                "role": "assistant",
                "content": [part],
            }
        call: dict[str, Any] = {"id": item_id, "call_id": call_id, "name": block.name, "status": status}
        if tool is not None and tool.namespace:
            call |= {"name": tool.client_name, "namespace": tool.namespace}
        if tool is not None and tool.custom:
            return {"type": "custom_tool_call", **call, "input": custom_input(block)}
        return {"type": "function_call", **call, "arguments": block.text}


def custom_input(block: Block) -> str:
    """A custom tool call's input text: its one argument (the arguments' JSON where the model wrote other
    ones)."""
    arguments: Any = block.arguments
    if arguments is None:
        try:
            arguments = json.loads(block.text or "{}")
        except ValueError:
            return block.text
    value = arguments.get(CUSTOM_INPUT) if isinstance(arguments, dict) else None
    return value if isinstance(value, str) else json.dumps(arguments, ensure_ascii=False)


class _Response:
    """The response object, as `response.created` announces it and `response.completed` closes it."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = {
            "id": new_id("resp_"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": body["model"],
            "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {},
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }

    def fail(self, code: str, message: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        self.body |= {"status": "failed", "error": {"code": code, "message": message}, "output": output}
        return self.body

    def finish(self, generation: Generation, output: list[dict[str, Any]]) -> dict[str, Any]:
        used = generation.usage
        self.body["output"] = output
        self.body["status"] = "incomplete" if generation.stopped_by_length else "completed"
        if generation.stopped_by_length:
            self.body["incomplete_details"] = {"reason": "max_output_tokens"}
        self.body["usage"] = {
            "input_tokens": used.prompt_tokens,
            "input_tokens_details": {"cached_tokens": used.cached_prompt_tokens},
            "output_tokens": used.generated_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": used.prompt_tokens + used.generated_tokens,
        }
        return self.body


async def responses(service: Service, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    params.get(body, "model", str, required=True)
    if body.get("previous_response_id"):
        raise bad_field(
            "previous_response_id", "is not supported: responses are not stored; send the whole input"
        )
    text = params.get(body, "text", dict) or {}
    json_answer = json_format(params.get(text, "format", dict, path="text."), "text.format", nested=False)
    choice = tool_choice(body.get("tool_choice"), declared_tools(body.get("tools")), nested=False)
    parallel = body.get("parallel_tool_calls", True) is not False
    prompt = await service.template.render(
        input_messages(body),
        choice.tools,
        _template_kwargs(body),
        choice.forced,
        json_answer=json_answer,
        parallel_calls=parallel,
        memo_scope=service.memo_scope(request),
    )
    requested = params.positive_int(body, "max_output_tokens")
    spec = TurnSpec(
        prompt.token_ids,
        await service.output_budget(request, len(prompt.token_ids), requested, responses_context_error),
        [],
        params.sampling(body, ("temperature", "top_p")),
        prompt.constraint,
    )
    generation = Generation(
        service,
        request,
        spec,
        service.template.parser(prompt, parse_tools=choice.parse_calls),
        session_id=params.get(body, "prompt_cache_key", str),
        user=params.get(body, "user", str),
    )
    blocks = Blocks(max_calls=None if parallel else 1)
    answer = _Response(body)
    items = _Items({tool.name: tool for tool in choice.tools})
    try:
        first = await generation.start(prompt.prefill)
        if params.get(body, "stream", bool):
            return await _Stream(request, items).run(generation, blocks, first, answer)
        blocks.feed(await generation.all_events(first))
        blocks.close()
    finally:
        generation.close()
    return web.json_response(answer.finish(generation, [items.item(b, "completed") for b in blocks.blocks]))


class _Stream:
    """A turn's server-sent events: each output item opened, grown and closed, numbered in sequence."""

    def __init__(self, request: web.Request, items: _Items) -> None:
        self.request = request
        self.items = items
        self.sequence = 0
        self.response: web.StreamResponse | None = None

    async def run(
        self, generation: Generation, blocks: Blocks, first: list[Any], answer: _Response
    ) -> web.StreamResponse:
        self.response = await sse.open_stream(self.request)
        await self.event("response.created", {"response": answer.body})
        await self.event("response.in_progress", {"response": answer.body})
        try:
            async for events in generation.stream(first):
                await self.send(blocks.feed(events))
            await self.send(blocks.close())
        except ApiError as error:  # after the headers: the error goes in the stream
            code = error.code or str(error.status)
            await self.event("error", {"code": code, "message": error.message, "param": error.param})
            # The response's own end: Codex reads the error from response.failed (an `error` event alone
            # is a stream that stopped, to it).
            output = [self.items.item(b, "incomplete") for b in blocks.blocks]
            await self.event("response.failed", {"response": answer.fail(code, error.message, output)})
            return self.response
        final = answer.finish(generation, [self.items.item(b, "completed") for b in blocks.blocks])
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        await self.event(kind, {"response": final})
        return self.response

    async def event(self, kind: str, data: dict[str, Any]) -> None:
        assert self.response is not None
        await sse.send(self.response, {"type": kind, "sequence_number": self.sequence, **data}, event=kind)
        self.sequence += 1

    async def send(self, steps: list[Step]) -> None:
        for step in steps:
            item = self.items.item(step.block, "completed" if step.action == "close" else "in_progress")
            where = {"item_id": item["id"], "output_index": step.block.index}
            if step.action == "open":
                await self.opened(step.block, item, where)
            elif step.action == "delta":
                await self.grown(step, item, where)
            else:
                await self.closed(step.block, item, where)

    async def opened(self, block: Block, item: dict[str, Any], where: dict[str, Any]) -> None:
        empty = {"function_call": {"arguments": ""}, "custom_tool_call": {"input": ""}}.get(item["type"])
        opened = item | (empty if empty is not None else {"content": []})
        await self.event("response.output_item.added", {"output_index": block.index, "item": opened})
        if block.kind == "text":
            part = {"type": "output_text", "text": "", "annotations": []}
            await self.event("response.content_part.added", where | {"content_index": 0, "part": part})

    async def grown(self, step: Step, item: dict[str, Any], where: dict[str, Any]) -> None:
        kind = {
            "function_call": "response.function_call_arguments.delta",
            "message": "response.output_text.delta",
            "reasoning": "response.reasoning_text.delta",
        }.get(item["type"])
        if kind is None:  # a custom tool's input is whole only once its arguments are: sent at the close
            return
        index = {} if item["type"] == "function_call" else {"content_index": 0}
        await self.event(kind, where | index | {"delta": step.delta})

    async def closed(self, block: Block, item: dict[str, Any], where: dict[str, Any]) -> None:
        if item["type"] == "function_call":
            await self.event("response.function_call_arguments.done", where | {"arguments": block.text})
        elif item["type"] == "custom_tool_call":
            await self.event("response.custom_tool_call_input.delta", where | {"delta": item["input"]})
            await self.event("response.custom_tool_call_input.done", where | {"input": item["input"]})
        elif item["type"] == "message":
            await self.event("response.output_text.done", where | {"content_index": 0, "text": block.text})
            part = item["content"][0]
            await self.event("response.content_part.done", where | {"content_index": 0, "part": part})
        else:
            text = where | {"content_index": 0, "text": block.text}
            await self.event("response.reasoning_text.done", text)
        await self.event("response.output_item.done", {"output_index": block.index, "item": item})

"""The Responses API, the subset Codex CLI uses: input items (messages, function calls and their outputs,
reasoning), function tools, and the streaming events. Nothing is stored: every request carries the whole
conversation (Codex sends `store: false`); `prompt_cache_key` keeps a conversation on its card."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from . import params, sse
from .errors import ApiError, bad_field, responses_context_error
from .events import Block, Blocks, Step
from .openai_api import (
    arguments_object,
    function_tools,
    json_format,
    template_call,
    text_content,
    tool_choice,
)
from .service import Generation, Service, TurnSpec, new_id

MESSAGE_ROLES = ("user", "assistant", "system", "developer")


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
        elif kind == "function_call":
            name = params.get(item, "name", str, path=f"{path}.", required=True)
            call_id = params.get(item, "call_id", str, path=f"{path}.", required=True)
            call = template_call(
                call_id, name, arguments_object(item.get("arguments", "{}"), f"{path}.arguments")
            )
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or "tool_calls" not in last:
                last = {"role": "assistant", "content": "", "tool_calls": []}
                messages.append(last)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, ""
            last["tool_calls"].append(call)
        elif kind == "function_call_output":
            call_id = params.get(item, "call_id", str, path=f"{path}.", required=True)
            output = item.get("output", "")
            text = output if isinstance(output, str) else text_content(output, f"{path}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            summary = item.get("summary") or []
            reasoning = "".join(part.get("text", "") for part in summary if isinstance(part, dict))
        else:
            raise bad_field(f"{path}.type", f"{kind!r} items are not supported")
    return messages


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    reasoning = params.get(body, "reasoning", dict)
    if reasoning is None or reasoning.get("effort") is None:
        return {}
    return {"enable_thinking": reasoning["effort"] not in ("none", "minimal")}


def _item(block: Block, ids: dict[int, tuple[str, str]], status: str) -> dict[str, Any]:
    item_id, call_id = ids.setdefault(
        block.index,
        (new_id({"reasoning": "rs_", "text": "msg_", "tool": "fc_"}[block.kind]), new_id("call_")),
    )
    if block.kind == "reasoning":
        return {
            "type": "reasoning",
            "id": item_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": block.text}],
        }
    if block.kind == "text":
        part = {"type": "output_text", "text": block.text, "annotations": []}
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": block.name,
        "arguments": block.text,
        "status": status,
    }


class _Response:
    """The response object, as `response.created` announces it and `response.completed` closes it."""

    def __init__(self, body: dict[str, Any], tools: list[Any]) -> None:
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
    json_answer = json_format(params.get(text, "format", dict, path="text."), "text.format")
    declared, forced = tool_choice(
        body.get("tool_choice"), function_tools(body.get("tools"), nested=False), nested=False
    )
    parallel = body.get("parallel_tool_calls", True) is not False
    prompt = await service.template.render(
        input_messages(body),
        declared,
        _template_kwargs(body),
        forced,
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
        service.template.parser(prompt, parse_tools=bool(declared)),
        session_id=params.get(body, "prompt_cache_key", str),
        user=params.get(body, "user", str),
    )
    blocks = Blocks(max_calls=None if parallel else 1)
    answer = _Response(body, declared)
    try:
        first = await generation.start(prompt.prefill)
        if params.get(body, "stream", bool):
            return await _stream(request, generation, blocks, first, answer)
        blocks.feed(await generation.all_events(first))
        blocks.close()
    finally:
        generation.close()
    ids: dict[int, tuple[str, str]] = {}
    return web.json_response(answer.finish(generation, [_item(b, ids, "completed") for b in blocks.blocks]))


async def _stream(
    request: web.Request, generation: Generation, blocks: Blocks, first: list[Any], answer: _Response
) -> web.StreamResponse:
    response = await sse.open_stream(request)
    ids: dict[int, tuple[str, str]] = {}
    sequence = 0

    async def event(kind: str, data: dict[str, Any]) -> None:
        nonlocal sequence
        await sse.send(response, {"type": kind, "sequence_number": sequence, **data}, event=kind)
        sequence += 1

    async def send(steps: list[Step]) -> None:
        for step in steps:
            block, index = step.block, step.block.index
            item = _item(block, ids, "completed" if step.action == "close" else "in_progress")
            where = {"item_id": item["id"], "output_index": index}
            if step.action == "open":
                opened = dict(item, arguments="") if block.kind == "tool" else dict(item, content=[])
                await event("response.output_item.added", {"output_index": index, "item": opened})
                if block.kind == "text":
                    part = {"type": "output_text", "text": "", "annotations": []}
                    await event("response.content_part.added", where | {"content_index": 0, "part": part})
            elif step.action == "delta":
                if block.kind == "tool":
                    await event("response.function_call_arguments.delta", where | {"delta": step.delta})
                else:
                    kind = (
                        "response.output_text.delta"
                        if block.kind == "text"
                        else "response.reasoning_text.delta"
                    )
                    await event(kind, where | {"content_index": 0, "delta": step.delta})
            else:
                if block.kind == "tool":
                    await event("response.function_call_arguments.done", where | {"arguments": block.text})
                elif block.kind == "text":
                    await event("response.output_text.done", where | {"content_index": 0, "text": block.text})
                    await event(
                        "response.content_part.done", where | {"content_index": 0, "part": item["content"][0]}
                    )
                else:
                    await event(
                        "response.reasoning_text.done", where | {"content_index": 0, "text": block.text}
                    )
                await event("response.output_item.done", {"output_index": index, "item": item})

    await event("response.created", {"response": answer.body})
    await event("response.in_progress", {"response": answer.body})
    try:
        async for events in generation.stream(first):
            await send(blocks.feed(events))
        await send(blocks.close())
    except ApiError as error:  # after the headers: the error goes in the stream
        await event(
            "error", {"code": error.code or str(error.status), "message": error.message, "param": error.param}
        )
        return response
    final = answer.finish(generation, [_item(b, ids, "completed") for b in blocks.blocks])
    await event(
        "response.incomplete" if final["status"] == "incomplete" else "response.completed",
        {"response": final},
    )
    return response

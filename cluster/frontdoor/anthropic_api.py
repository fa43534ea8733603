"""Anthropic's Messages API (what Claude Code speaks) and its token counter."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from . import params, sse
from .errors import ApiError, anthropic_context_error, bad_field
from .events import Block, Blocks, Step
from .openai_api import IMAGE_PLACEHOLDER, PART_SEPARATOR, ToolChoice, template_call, tool_choice
from .service import Generation, Service, TurnSpec, new_id
from .template import Prompt, Tool


def _blocks(content: Any, path: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_field(path, f"must be a string or a list of content blocks, got {type(content).__name__}")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_field(f"{path}[{j}]", "must be a content block with a type")
    return content


def _text(block: dict[str, Any], path: str) -> str:
    return params.get(block, "text", str, path=f"{path}.", required=True)


READABLE_BLOCKS = ("text", "image", "document")
# What stands for a PDF or a linked document: like an image, it stays in the conversation as a mark.
DOCUMENT_PLACEHOLDER = "[document omitted: this model reads text only]"


def _readable_text(block: dict[str, Any], path: str) -> str:
    """A text, image or document block as the prompt's text (images and binary documents as placeholders)."""
    if block["type"] == "image":
        return IMAGE_PLACEHOLDER
    if block["type"] == "document":
        return _document_text(block, path)
    return _text(block, path)


def _document_text(block: dict[str, Any], path: str) -> str:
    """A document's text (a plain-text source, or one of content blocks) under its title; a PDF or a URL,
    which this model cannot read, as a placeholder."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_field(f"{path}.source", "must be an object")
    kind = source.get("type")
    if kind == "text":
        text = params.get(source, "data", str, path=f"{path}.source.", required=True)
    elif kind == "content":
        text = _readable_join(
            _blocks(source.get("content"), f"{path}.source.content"), f"{path}.source.content"
        )
    elif kind in ("base64", "url", "file"):
        return DOCUMENT_PLACEHOLDER
    else:
        raise bad_field(
            f"{path}.source.type", f"must be 'text', 'content', 'base64', 'url' or 'file', got {kind!r}"
        )
    title = block.get("title")
    return f"{title}\n{text}" if isinstance(title, str) and title else text


def _readable_join(parts: list[dict[str, Any]], path: str) -> str:
    for j, part in enumerate(parts):
        if part["type"] not in READABLE_BLOCKS:
            raise bad_field(
                f"{path}[{j}]", f"only text, images and documents are supported, got {part['type']!r}"
            )
    return PART_SEPARATOR.join(_readable_text(part, f"{path}[{j}]") for j, part in enumerate(parts))


def _tool_result_text(block: dict[str, Any], path: str) -> str:
    content = block.get("content", "")
    text = (
        content
        if isinstance(content, str)
        else _readable_join(_blocks(content, f"{path}.content"), f"{path}.content")
    )
    return f"Error: {text}" if block.get("is_error") else text


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic's system and messages as the template's messages (tool results become tool messages)."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        blocks = _blocks(system, "system")
        text = "\n\n".join(_text(b, f"system[{j}]") for j, b in enumerate(blocks) if b["type"] == "text")
        if text:
            messages.append({"role": "system", "content": text})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_field("messages", "must be a non-empty array of messages")
    for i, message in enumerate(raw):
        path = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            role = message.get("role") if isinstance(message, dict) else None
            raise bad_field(f"{path}.role", f"must be 'user' or 'assistant', got {role!r}")
        blocks = _blocks(message.get("content"), f"{path}.content")
        if message["role"] == "user":
            messages += _user_messages(blocks, f"{path}.content")
        else:
            messages.append(_assistant_message(blocks, f"{path}.content"))
    return messages


def _user_messages(blocks: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, block in enumerate(blocks):
        where = f"{path}[{j}]"
        if block["type"] in READABLE_BLOCKS:
            text.append(_readable_text(block, where))
        elif block["type"] == "tool_result":
            call_id = params.get(block, "tool_use_id", str, path=f"{where}.", required=True)
            out.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, where)})
        else:
            raise bad_field(f"{where}.type", f"{block['type']!r} blocks are not supported in user turns")
    if text:
        out.append({"role": "user", "content": PART_SEPARATOR.join(text)})
    return out


def _assistant_message(blocks: list[dict[str, Any]], path: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": []}
    texts = []
    for j, block in enumerate(blocks):
        where = f"{path}[{j}]"
        if block["type"] == "text":
            texts.append(_text(block, where))
        elif block["type"] == "tool_use":
            name = params.get(block, "name", str, path=f"{where}.", required=True)
            arguments = params.get(block, "input", dict, path=f"{where}.") or {}
            message["tool_calls"].append(template_call(str(block.get("id") or ""), name, arguments))
        elif block["type"] == "thinking":
            message["reasoning_content"] = params.get(block, "thinking", str, path=f"{where}.") or ""
        elif block["type"] != "redacted_thinking":
            raise bad_field(f"{where}.type", f"{block['type']!r} blocks are not supported in assistant turns")
    message["content"] = PART_SEPARATOR.join(texts)
    return message


def tools(body: dict[str, Any]) -> list[Tool]:
    raw = params.get(body, "tools", list) or []
    declared: dict[str, Tool] = {}
    for i, tool in enumerate(raw):
        path = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad_field(f"{path}.type", f"only client tools are supported, got {kind!r}")
        name = params.get(tool, "name", str, path=f"{path}.", required=True)
        if name in declared:
            raise bad_field(f"{path}.name", f"tool {name!r} is declared twice")
        schema = params.tool_schema(tool, "input_schema", path=f"{path}.", required=True)
        declared[name] = Tool(name, params.get(tool, "description", str, path=f"{path}.") or "", schema)
    return list(declared.values())


def _choice(body: dict[str, Any]) -> tuple[Any, bool]:
    """tool_choice in OpenAI's terms, and whether parallel calls are allowed."""
    raw = params.get(body, "tool_choice", dict)
    if raw is None:
        return None, True
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    kind = raw.get("type")
    if kind == "tool":
        choice: Any = {"type": "function", "function": {"name": raw.get("name")}}
    elif isinstance(kind, str) and kind in kinds:
        choice = kinds[kind]
    else:
        raise bad_field("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', got {kind!r}")
    return choice, not raw.get("disable_parallel_tool_use", False)


def _thinking(body: dict[str, Any]) -> dict[str, Any]:
    """`thinking` as the template's switch. `adaptive` (Claude Code at high effort) lets the model decide
    how much to think: thinking on; `budget_tokens` and `output_config.effort` have no counterpart here."""
    raw = params.get(body, "thinking", dict)
    if raw is None:
        return {}
    kind = raw.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_field("thinking.type", f"must be 'enabled', 'adaptive' or 'disabled', got {kind!r}")
    return {"enable_thinking": kind != "disabled"}


async def _prompt(
    service: Service, request: web.Request, body: dict[str, Any]
) -> tuple[Prompt, ToolChoice, bool]:
    """The turn's prompt, its tool choice, and whether parallel calls are allowed."""
    params.get(body, "model", str, required=True)
    raw, parallel = _choice(body)
    choice = tool_choice(raw, tools(body))
    # A final assistant message is the start of the answer (Anthropic's prefill).
    prompt = await service.template.render(
        chat_messages(body),
        choice.tools,
        _thinking(body),
        choice.forced,
        continue_final=True,
        parallel_calls=parallel,
        memo_scope=service.memo_scope(request),
    )
    return prompt, choice, parallel


def _usage(generation: Generation) -> dict[str, Any]:
    used = generation.usage
    return {
        "input_tokens": used.prompt_tokens - used.cached_prompt_tokens,
        "output_tokens": used.generated_tokens,
        "cache_read_input_tokens": used.cached_prompt_tokens,
        "cache_creation_input_tokens": 0,
    }


def _stop(generation: Generation, blocks: Blocks) -> tuple[str, str | None]:
    if generation.stopped_by_length:
        return "max_tokens", None
    if blocks.tool_calls:
        return "tool_use", None
    finished = generation.finished
    if finished is not None and finished.WhichOneof("stopped_by") == "stop_string":
        return "stop_sequence", finished.stop_string
    return "end_turn", None


def _content(block: Block, tool_ids: dict[int, str]) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    tool_ids.setdefault(block.index, new_id("toolu_"))
    return {
        "type": "tool_use",
        "id": tool_ids[block.index],
        "name": block.name,
        "input": block.arguments or {},
    }


async def messages(service: Service, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    prompt, choice, parallel = await _prompt(service, request, body)
    requested = params.positive_int(body, "max_tokens", required=True)
    spec = TurnSpec(
        prompt.token_ids,
        await service.output_budget(request, len(prompt.token_ids), requested, anthropic_context_error),
        params.stop_strings(body, "stop_sequences"),
        params.sampling(body, ("temperature", "top_p", "top_k")),
        prompt.constraint,
    )
    metadata = params.get(body, "metadata", dict) or {}
    generation = Generation(
        service,
        request,
        spec,
        service.template.parser(prompt, parse_tools=choice.parse_calls),
        user=params.get(metadata, "user_id", str, path="metadata."),
    )
    blocks = Blocks(max_calls=None if parallel else 1)
    message = {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": body["model"]}
    try:
        first = await generation.start(prompt.prefill)
        if params.get(body, "stream", bool):
            return await _stream(request, generation, blocks, first, message, len(prompt.token_ids))
        blocks.feed(await generation.all_events(first))
        blocks.close()
    finally:
        generation.close()
    tool_ids: dict[int, str] = {}
    content = [_content(block, tool_ids) for block in blocks.blocks] or [{"type": "text", "text": ""}]
    stop_reason, stop_sequence = _stop(generation, blocks)
    return web.json_response(
        message
        | {
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(generation),
        }
    )


async def _stream(
    request: web.Request,
    generation: Generation,
    blocks: Blocks,
    first: list[Any],
    message: dict[str, Any],
    prompt_tokens: int,
) -> web.StreamResponse:
    response = await sse.open_stream(request)
    tool_ids: dict[int, str] = {}

    async def event(kind: str, data: dict[str, Any]) -> None:
        await sse.send(response, {"type": kind, **data}, event=kind)

    async def send(steps: list[Step]) -> None:
        for step in steps:
            index = step.block.index
            if step.action == "open":
                start = _content(step.block, tool_ids)
                if step.block.kind == "tool":
                    start["input"] = {}
                else:
                    start[("thinking" if step.block.kind == "reasoning" else "text")] = ""
                await event("content_block_start", {"index": index, "content_block": start})
            elif step.action == "delta":
                kind = step.block.kind
                delta = (
                    {"type": "input_json_delta", "partial_json": step.delta}
                    if kind == "tool"
                    else {"type": "thinking_delta", "thinking": step.delta}
                    if kind == "reasoning"
                    else {"type": "text_delta", "text": step.delta}
                )
                await event("content_block_delta", {"index": index, "delta": delta})
            else:
                await event("content_block_stop", {"index": index})

    start_usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
    await event(
        "message_start",
        {
            "message": message
            | {"content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}
        },
    )
    try:
        async for events in generation.stream(first):
            await send(blocks.feed(events))
        await send(blocks.close())
    except ApiError as error:  # after the headers: the error goes in the stream, as Anthropic sends it
        await event("error", {"error": error.anthropic_body()["error"]})
        return response
    stop_reason, stop_sequence = _stop(generation, blocks)
    await event(
        "message_delta",
        {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": _usage(generation)},
    )
    await event("message_stop", {})
    return response


async def count_tokens(service: Service, request: web.Request, body: dict[str, Any]) -> web.Response:
    prompt, _, _ = await _prompt(service, request, body)
    return web.json_response({"input_tokens": len(prompt.token_ids)})

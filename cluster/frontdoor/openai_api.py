"""OpenAI's Chat Completions, Completions and Models APIs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from . import params, sse
from .errors import ApiError, bad_field, chat_context_error, completion_context_error
from .events import Collected, Event, Reasoning, Text, ToolCallArguments, ToolCallBegin
from .service import Generation, Service, TurnSpec, new_id
from .template import REQUIRED, Tool

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PART_TYPES = ("text", "input_text", "output_text")
IMAGE_PART_TYPES = ("image_url", "input_image")  # Chat Completions', the Responses API's
# Between the text parts of one message, as vLLM joins them: agents put separate sections in separate parts
# (Cline's <task> and <environment_details>, Claude Code's <system-reminder> blocks), which must not run
# into each other.
PART_SEPARATOR = "\n"
# What stands for an image in the prompt: a conversation that once held a screenshot goes on (the model is
# told something was there) rather than every later turn being refused.
IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"


# ---- request parsing, shared with the Responses API ---------------------------------------------------
def text_content(value: Any, field: str, *, allow_none: bool = False) -> str:
    """Content as a string or a list of text parts, as one string."""
    if value is None and allow_none:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_field(field, f"must be a string or a list of text parts, got {type(value).__name__}")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in IMAGE_PART_TYPES:
            texts.append(IMAGE_PLACEHOLDER)
        elif kind in TEXT_PART_TYPES:
            texts.append(params.get(part, "text", str, path=f"{field}[{j}].", required=True))
        else:
            raise bad_field(f"{field}[{j}]", f"only text and image parts are supported, got {kind!r}")
    return PART_SEPARATOR.join(texts)


def arguments_object(value: Any, field: str) -> dict[str, Any]:
    """A call's arguments (a JSON string, as OpenAI sends them, or an object) as the object templates read."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as e:
            raise bad_field(field, f"is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise bad_field(field, "must be a JSON object")
    return value


def template_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad_field("messages", "must be a non-empty array of messages")
    messages = []
    for i, message in enumerate(raw):
        path = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_field(path, f"must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_field(f"{path}.role", f"must be one of {list(CHAT_ROLES)}, got {role!r}")
        out: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": text_content(
                message.get("content"), f"{path}.content", allow_none=role == "assistant"
            ),
        }
        if role == "assistant":
            calls = params.get(message, "tool_calls", list, path=f"{path}.") or []
            out["tool_calls"] = [
                _history_call(call, f"{path}.tool_calls[{j}]") for j, call in enumerate(calls)
            ]
            thought = message.get("reasoning_content") or message.get("reasoning")
            if isinstance(thought, str) and thought:
                out["reasoning_content"] = thought
        if role == "tool":
            out["tool_call_id"] = params.get(message, "tool_call_id", str, path=f"{path}.") or ""
        messages.append(out)
    return messages


def _history_call(call: Any, path: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise bad_field(path, "must be an object")
    function = params.get(call, "function", dict, path=f"{path}.", required=True)
    name = params.get(function, "name", str, path=f"{path}.function.", required=True)
    arguments = arguments_object(function.get("arguments", "{}"), f"{path}.function.arguments")
    return template_call(str(call.get("id") or ""), name, arguments)


def function_tool(spec: dict[str, Any], where: str) -> Tool:
    """A function's {name, description, parameters}; `where` is the path its fields' errors name."""
    name = params.get(spec, "name", str, path=where, required=True)
    schema = params.tool_schema(spec, "parameters", path=where) or {"type": "object", "properties": {}}
    return Tool(name, params.get(spec, "description", str, path=where) or "", schema)


def add_tool(tools: dict[str, Tool], tool: Tool, where: str) -> None:
    if tool.name in tools:
        raise bad_field(f"{where}name", f"tool {tool.name!r} is declared twice")
    tools[tool.name] = tool


def function_tools(raw: Any) -> list[Tool]:
    """Chat Completions' tools: {"type": "function", "function": {name, description, parameters}}; any other
    type is a 400, as OpenAI answers for a type it does not know."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_field("tools", "must be an array of tools")
    tools: dict[str, Tool] = {}
    for i, tool in enumerate(raw):
        path = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad_field(f"{path}.type", f"only function tools are supported, got {kind!r}")
        spec = params.get(tool, "function", dict, path=f"{path}.", required=True)
        add_tool(tools, function_tool(spec, f"{path}.function."), f"{path}.function.")
    return list(tools.values())


@dataclass(frozen=True)
class ToolChoice:
    """What a request's tool_choice means for the turn: the tools the prompt declares, the call the answer
    is made to start with (a tool's name, REQUIRED, or None), and whether calls in the output are taken as
    calls (with "none" they stay text)."""

    tools: list[Tool]
    forced: str | object | None = None
    calls: bool = True

    @property
    def parse_calls(self) -> bool:
        return self.calls and bool(self.tools)


def tool_choice(raw: Any, tools: list[Tool], *, nested: bool = True) -> ToolChoice:
    """ "required" / a named function force a call; "none" still declares the tools, so that the prompt
    keeps the prefix of the turns around it (agents switch it per turn), and takes no call from the
    output."""
    if raw is None or raw == "auto":
        return ToolChoice(tools)
    if raw == "none":
        return ToolChoice(tools, calls=False)
    if not tools:
        raise bad_field("tool_choice", f"{raw!r} needs tools")
    if raw == "required":
        return ToolChoice(tools, REQUIRED)
    # The Responses API names a custom tool as it names a function (`nested=False`).
    kinds = ("function",) if nested else ("function", "custom")
    if isinstance(raw, dict) and raw.get("type") in kinds:
        spec = raw.get("function") if nested else raw
        name = spec.get("name") if isinstance(spec, dict) else None
        custom = raw["type"] == "custom"
        named = [t.name for t in tools if name in (t.name, t.client_name) and t.custom == custom]
        if not named:
            raise bad_field("tool_choice", f"names no declared tool: {name!r}")
        return ToolChoice(tools, named[0])
    raise bad_field("tool_choice", f"must be 'auto', 'none', 'required' or a function, got {raw!r}")


def json_format(value: dict[str, Any] | None, field: str, *, nested: bool = True) -> bool:
    """Whether a response format (Chat Completions' `response_format`, Responses' `text.format`, whose
    `json_schema` fields are not `nested`) asks for a JSON object. A JSON schema is accepted as a request
    for a JSON object, the one shape the cards can enforce: its root must be an object, and nothing below
    the root is checked (docs/http.md says so)."""
    kind = (value or {}).get("type", "text")
    if kind in ("text", "json_object"):
        return kind == "json_object"
    if kind != "json_schema":
        raise bad_field(f"{field}.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    assert value is not None
    where = f"{field}.json_schema." if nested else f"{field}."
    spec = params.get(value, "json_schema", dict, path=f"{field}.", required=True) if nested else value
    schema = params.get(spec, "schema", dict, path=where, required=True)
    if schema.get("type", "object") != "object":
        raise bad_field(
            f"{where}schema.type",
            f"must be 'object', got {schema['type']!r}: only a JSON object answer can be enforced",
        )
    return True


def thinking_switch(effort: str | None) -> dict[str, Any]:
    """A reasoning effort (Chat Completions' `reasoning_effort`, Responses' `reasoning.effort`) as the
    template's switch: `none` and `minimal` turn thinking off, any other level on; unset, the template's
    own default."""
    return {} if effort is None else {"enable_thinking": effort not in ("none", "minimal")}


def max_tokens(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = params.positive_int(body, name)
        if value is not None:
            return value
    return None


def usage(generation: Generation) -> dict[str, Any]:
    used = generation.usage
    return {
        "prompt_tokens": used.prompt_tokens,
        "completion_tokens": used.generated_tokens,
        "total_tokens": used.prompt_tokens + used.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": used.cached_prompt_tokens},
    }


def finish_reason(generation: Generation) -> str:
    if generation.stopped_by_length:
        return "length"
    return "tool_calls" if generation.tool_calls else "stop"


def _common_fields(body: dict[str, Any]) -> None:
    params.get(body, "model", str, required=True)
    n = params.positive_int(body, "n")
    if n not in (None, 1):
        raise bad_field("n", f"only n = 1 is supported, got {n}")
    params.unsupported(body, "logprobs", (False,), "no log probabilities")
    params.unsupported(body, "best_of", (1,), "one candidate per request")
    params.get(body, "user", str)


def _include_usage(body: dict[str, Any]) -> bool:
    options = params.get(body, "stream_options", dict) or {}
    return bool(params.get(options, "include_usage", bool, path="stream_options."))


# ---- /v1/chat/completions -----------------------------------------------------------------------------
async def chat_completions(
    service: Service, request: web.Request, body: dict[str, Any]
) -> web.StreamResponse:
    _common_fields(body)
    params.unsupported(body, "top_logprobs", (0,), "no log probabilities")
    json_answer = json_format(params.get(body, "response_format", dict), "response_format")
    messages = chat_messages(body.get("messages"))
    choice = tool_choice(body.get("tool_choice"), function_tools(body.get("tools")))
    parallel = params.get(body, "parallel_tool_calls", bool)
    # chat_template_kwargs says it outright; reasoning_effort (opencode, LiteLLM) is the same switch.
    kwargs = thinking_switch(params.get(body, "reasoning_effort", str)) | (
        params.get(body, "chat_template_kwargs", dict) or {}
    )
    # vLLM's extension: a final assistant message the model continues (rather than a new turn).
    continue_final = bool(params.get(body, "continue_final_message", bool))
    prompt = await service.template.render(
        messages,
        choice.tools,
        kwargs,
        choice.forced,
        continue_final=continue_final,
        json_answer=json_answer,
        parallel_calls=parallel is not False,
        memo_scope=service.memo_scope(request),
    )
    sampling = params.sampling(body)
    params.logit_bias(body, sampling)
    requested = max_tokens(body, "max_completion_tokens", "max_tokens")
    spec = TurnSpec(
        prompt.token_ids,
        await service.output_budget(request, len(prompt.token_ids), requested, chat_context_error),
        params.stop_strings(body, "stop"),
        sampling,
        prompt.constraint,
    )
    parser = service.template.parser(prompt, parse_tools=choice.parse_calls)
    generation = Generation(service, request, spec, parser, user=params.get(body, "user", str))
    stream = params.get(body, "stream", bool)
    try:
        first = await generation.start(prompt.prefill)
        if stream:
            return await _stream_chat(
                request, generation, first, body["model"], _include_usage(body), parallel is not False
            )
        collected = Collected()
        collected.add(await generation.all_events(first))
    finally:
        generation.close()
    calls = collected.tool_calls if parallel is not False else collected.tool_calls[:1]
    message: dict[str, Any] = {"role": "assistant", "content": collected.text or (None if calls else "")}
    if collected.reasoning:
        message["reasoning_content"] = message["reasoning"] = collected.reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": new_id("call_"),
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for c in calls
        ]
    return web.json_response(
        {
            "id": new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": generation.created,
            "model": body["model"],
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(generation)}
            ],
            "usage": usage(generation),
        }
    )


async def _stream_chat(
    request: web.Request,
    generation: Generation,
    first: list[Event],
    model: str,
    include_usage: bool,
    parallel: bool,
) -> web.StreamResponse:
    response = await sse.open_stream(request)
    completion_id = new_id("chatcmpl-")

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": generation.created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if include_usage:
            data["usage"] = None
        return data

    async def send_events(events: list[Event]) -> None:
        for event in events:
            delta = _chat_delta(event, parallel)
            if delta is not None:
                await sse.send(response, chunk(delta))

    await sse.send(response, chunk({"role": "assistant", "content": ""}))
    try:
        async for events in generation.stream(first):
            await send_events(events)
    except ApiError as error:  # after the headers: the error goes in the stream, as OpenAI sends it
        await sse.send(response, error.openai_body())
        await sse.send(response, "[DONE]")
        return response
    await sse.send(response, chunk({}, finish_reason(generation)))
    if include_usage:
        data = chunk({})
        data["choices"], data["usage"] = [], usage(generation)
        await sse.send(response, data)
    await sse.send(response, "[DONE]")
    return response


def _chat_delta(event: Event, parallel: bool) -> dict[str, Any] | None:
    if isinstance(event, Text):
        return {"content": event.text}
    if isinstance(event, Reasoning):
        return {"reasoning_content": event.text, "reasoning": event.text}
    if isinstance(event, (ToolCallBegin, ToolCallArguments)) and (parallel or event.index == 0):
        if isinstance(event, ToolCallBegin):
            call = {
                "index": event.index,
                "id": new_id("call_"),
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
        else:
            call = {"index": event.index, "function": {"arguments": event.fragment}}
        return {"tool_calls": [call]}
    return None


# ---- /v1/completions ----------------------------------------------------------------------------------
async def completions(service: Service, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    _common_fields(body)
    params.unsupported(body, "echo", (False,), "the prompt is not echoed")
    params.unsupported(body, "suffix", ("",), "no fill-in-the-middle")
    prompt_ids = await _completion_prompt(service, body.get("prompt"))
    sampling = params.sampling(body)
    params.logit_bias(body, sampling)
    # 16 when unset, as OpenAI's Completions API does.
    requested = max_tokens(body, "max_tokens") or 16
    budget = await service.output_budget(request, len(prompt_ids), requested, completion_context_error)
    spec = TurnSpec(prompt_ids, budget, params.stop_strings(body, "stop"), sampling)
    generation = Generation(service, request, spec, None, user=params.get(body, "user", str))
    completion_id = new_id("cmpl-")

    def choice(text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": generation.created,
            "model": body["model"],
            "choices": choices,
        }

    try:
        await generation.start()
        if params.get(body, "stream", bool):
            response = await sse.open_stream(request)
            try:
                async for events in generation.events():
                    for event in events:
                        assert isinstance(event, Text)
                        await sse.send(response, envelope([choice(event.text, None)]))
            except ApiError as error:
                await sse.send(response, error.openai_body())
                await sse.send(response, "[DONE]")
                return response
            await sse.send(response, envelope([choice("", finish_reason(generation))]))
            if _include_usage(body):
                await sse.send(response, envelope([]) | {"usage": usage(generation)})
            await sse.send(response, "[DONE]")
            return response
        text = "".join(e.text for e in await generation.all_events([]) if isinstance(e, Text))
    finally:
        generation.close()
    return web.json_response(
        envelope([choice(text, finish_reason(generation))]) | {"usage": usage(generation)}
    )


async def _completion_prompt(service: Service, prompt: Any) -> list[int]:
    """A text prompt or token ids; a list of one prompt is that prompt (several: one request each)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_field("prompt", f"one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return service.template.tokenizer.encode(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    raise bad_field("prompt", "must be a non-empty string or a non-empty array of token ids")


# ---- /v1/models ---------------------------------------------------------------------------------------
def model_card(service: Service) -> dict[str, Any]:
    """The served model, with its context under vLLM's name (`max_model_len`) and OpenRouter's
    (`context_length`), for clients that size their window from discovery."""
    card: dict[str, Any] = {"id": service.model, "object": "model", "created": 0, "owned_by": "onestream"}
    if service.max_context is not None:
        card |= {"max_model_len": service.max_context, "context_length": service.max_context}
    return card


async def list_models(service: Service, request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(service)]})


async def get_model(service: Service, request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name != service.model:
        raise ApiError(
            404, f"model {name!r} does not exist; this pool serves {service.model!r}", param="model"
        )
    return web.json_response(model_card(service))

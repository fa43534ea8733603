"""Chat turns rendered by the model's own template: which tool-call form it writes, the embedded model's
template with tools, forced calls, and the fallback for templates that refuse a late system message."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from onestream.cluster.frontdoor.errors import ApiError
from onestream.cluster.frontdoor.template import REQUIRED, ChatTemplate, Prompt, Tool
from onestream.cluster.frontdoor.toolcalls import JSON, XML
from onestream.worker.loading import default_model_dir
from onestream.worker.tokenizer import Tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
WRITE = Tool("write_file", "Write a file", {"type": "object", "properties": {"content": {"type": "string"}}})
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "write_file", "arguments": {"content": "import os"}},
}
# How an older Qwen template writes calls (JSON in tags), and one that refuses a system message after the
# first, as the stock Qwen3 templates do.
JSON_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{%- endfor %}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}"
)
STRICT_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def embedded() -> Tokenizer:
    return load_tokenizer(default_model_dir())


def with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(
        tokenizer.backend, chat_templates={"default": template}, special_tokens=tokenizer.special_tokens
    )


def render(
    template: ChatTemplate, messages: list[dict[str, Any]], tools: list[Tool], **kwargs: Any
) -> Prompt:
    return asyncio.run(template.render(messages, tools, {}, **kwargs))


def test_the_embedded_template_writes_the_qwen35_xml_form_and_keeps_turns_prefixes(
    embedded: Tokenizer,
) -> None:
    template = ChatTemplate(embedded)
    assert template.tool_format == XML
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Save it."}]
    first = render(template, turn, [WRITE])
    assert "<tools>" in first.text and '"name": "write_file"' in first.text and not first.reasoning
    written = "<tool_call>\n<function=write_file>\n<parameter=content>\nimport os\n</parameter>\n</function>\n</tool_call>"
    history = [
        *turn,
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "saved"},
        {"role": "system", "content": "Now test it."},  # Claude Code sends system turns late
    ]
    second = render(template, history, [WRITE])
    # What the model wrote re-renders to the same text: the second turn's prompt extends the first's (the
    # card's cache and the router's prefix index depend on it).
    assert second.text.startswith(first.text + written)
    assert "<tool_response>\nsaved\n</tool_response>" in second.text and "Now test it." in second.text
    assert second.token_ids[: len(first.token_ids)] == first.token_ids


def test_thinking_and_forced_calls(embedded: Tokenizer) -> None:
    template = ChatTemplate(embedded)
    user = [{"role": "user", "content": "Save it."}]
    thinking = asyncio.run(template.render(user, [WRITE], {"enable_thinking": True}))
    assert thinking.reasoning and thinking.text.endswith("<think>\n")
    named = asyncio.run(template.render(user, [WRITE], {"enable_thinking": True}, "write_file"))
    assert named.prefill == "</think>\n\n<tool_call>\n<function=write_file>\n"
    assert named.text.endswith(named.prefill)
    assert render(template, user, [WRITE], forced=REQUIRED).prefill == "<tool_call>\n<function="
    continued = render(template, [*user, {"role": "assistant", "content": "Sure"}], [], continue_final=True)
    assert continued.text.endswith("<|im_start|>assistant\nSure") and continued.prefill == "Sure"


def test_an_older_template_writes_the_json_form(embedded: Tokenizer) -> None:
    template = ChatTemplate(with_template(embedded, JSON_TEMPLATE))
    assert template.tool_format == JSON
    prompt = render(template, [{"role": "user", "content": "x"}], [WRITE], forced="write_file")
    assert prompt.reasoning and prompt.prefill.endswith('<tool_call>\n{"name": "write_file", "arguments": ')
    parser = template.parser(prompt, parse_tools=True)
    events = (
        parser.feed(prompt.prefill) + parser.feed('{"content": "x = 1"}}\n</tool_call>') + parser.finish()
    )
    assert events[-1].arguments == {"content": "x = 1"}  # type: ignore[union-attr]


def test_a_template_without_tools_refuses_them_and_late_system_messages_become_user_turns(
    embedded: Tokenizer,
) -> None:
    template = ChatTemplate(with_template(embedded, STRICT_TEMPLATE))
    assert template.tool_format is None
    with pytest.raises(ApiError, match="tools: this model's chat template does not render tools"):
        render(template, [{"role": "user", "content": "x"}], [WRITE])
    messages = [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]
    assert "<|im_start|>user\nlate" in render(template, messages, []).text


def test_a_long_turn_is_encoded_by_segment_in_the_callers_scope() -> None:
    """The front door encodes every chat turn (the router routes by tokens): a long conversation resent with
    one more message encodes only that message, remembered per caller's key (Service.memo_scope), and the
    ids are the whole text's."""
    from aiohttp.test_utils import make_mocked_request
    from onestream.cluster.frontdoor.service import Service
    from onestream.worker.prefixes import TEAM_SCOPE

    tokenizer = load_tokenizer(default_model_dir())  # its own memo
    template = ChatTemplate(tokenizer)
    service = Service(router=None, template=template, model="m")  # type: ignore[arg-type]

    def scope(headers: dict[str, str], sharing: str = "user") -> str:
        service.prefix_sharing = sharing
        return service.memo_scope(make_mocked_request("POST", "/v1/chat/completions", headers=headers))

    alice, bob = scope({"Authorization": "Bearer key-a"}), scope({"x-api-key": "key-b"})
    assert alice != bob and alice == scope({"Authorization": "Bearer key-a"})
    assert "key-a" not in alice  # the key itself is not kept
    assert scope({}) == TEAM_SCOPE and scope({"Authorization": "Bearer key-a"}, "team") == TEAM_SCOPE
    source = (REPO / "cluster" / "router.py").read_text()
    messages = [
        {"role": "system", "content": source[:12000]},
        {"role": "user", "content": source[12000:14000]},
    ]
    first = render(template, messages, [], memo_scope=alice)
    remembered = tokenizer._segments.remembered_chars
    assert remembered >= 12000
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": source[14000:15000]}]
    second = render(template, messages, [], memo_scope=alice)
    assert second.token_ids == tokenizer.backend.encode(second.text, add_special_tokens=False).ids
    assert second.token_ids[: len(first.token_ids) - 3] == first.token_ids[:-3]  # the earlier turns' ids kept
    assert tokenizer._segments.remembered_chars - remembered <= 1100  # only the new messages were added

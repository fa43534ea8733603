"""A generation request and its validation: everything is checked before any work is done."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ContextLengthError, InvalidRequestError, quoted
from .sampling import SamplingParams

Message = dict[str, Any]
Prompt = str | list[int] | list[Message]

MESSAGE_ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_ID_CHARS = 256
# A text or chat prompt of more UTF-8 bytes than this per context token is refused before it is tokenized:
# source code and prose average 3-4 bytes per token, so only padding runs could fit and still be refused.
PROMPT_BYTES_PER_TOKEN = 8


def max_prompt_bytes(max_context: int) -> int:
    """The most UTF-8 bytes a text prompt (or a chat prompt's contents) may have for this context."""
    return max_context * PROMPT_BYTES_PER_TOKEN


def utf8_length(text: str, limit: int) -> int:
    """The UTF-8 length of `text`, or just its character count when that already exceeds `limit` (a
    character is at least a byte: a huge string is measured without being encoded)."""
    return len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))


@dataclass
class GenerateRequest:
    """A full prompt (text, token ids or chat messages) and how to continue it.

    `session_id` names a conversation whose state the engine may keep between turns; `request_id` names
    this turn (for cancellation and logs); `user` is the authenticated caller the router admitted it for
    (None when the pool runs without API keys), never taken from the request body.
    """

    prompt: Prompt
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    session_id: str | None = None
    request_id: str | None = None
    ignore_eos: bool = False
    user: str | None = None

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], dict)

    def validate(self, *, vocab_size: int | None = None, max_context: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field. Needs no model; the prompt's length in
        tokens is checked separately by `check_context` once it is tokenised."""
        _validate_prompt(self.prompt, vocab_size)
        if max_context is not None:
            _check_prompt_bytes(self.prompt, max_context)
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        self.sampling.validate(vocab_size)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError(f"max_tokens must be an integer, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if max_context is not None and self.max_tokens >= max_context:
            raise ContextLengthError(
                f"max_tokens={self.max_tokens} does not fit in the context of {max_context} tokens"
            )
        _validate_stop(self.stop)
        _validate_token_ids(
            "stop_token_ids", self.stop_token_ids, vocab_size, MAX_STOP_TOKEN_IDS, allow_empty=True
        )
        for name in ("session_id", "request_id", "user"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
                raise InvalidRequestError(
                    f"{name} must be a non-empty string of at most {MAX_ID_CHARS} characters"
                )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    def check_context(self, prompt_tokens: int, max_context: int) -> None:
        """The prompt plus max_tokens must fit in the context."""
        if prompt_tokens + self.max_tokens > max_context:
            raise ContextLengthError(
                f"prompt of {prompt_tokens} tokens + max_tokens={self.max_tokens} = "
                f"{prompt_tokens + self.max_tokens} exceeds the context of {max_context} tokens"
            )


def _validate_prompt(prompt: object, vocab_size: int | None) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        return
    if not isinstance(prompt, list):
        raise InvalidRequestError(
            f"prompt must be a string, a list of token ids or a list of messages, got {type(prompt).__name__}"
        )
    if not prompt:
        raise InvalidRequestError("prompt is empty")
    if isinstance(prompt[0], dict):
        for i, message in enumerate(prompt):
            if not isinstance(message, dict):
                raise InvalidRequestError(f"prompt[{i}] must be a message dict with role and content")
            role, content = message.get("role"), message.get("content")
            if role not in MESSAGE_ROLES:
                raise InvalidRequestError(
                    f"prompt[{i}].role must be one of {MESSAGE_ROLES}, got {quoted(role)}"
                )
            if not isinstance(content, str):
                raise InvalidRequestError(
                    f"prompt[{i}].content must be a string, got {type(content).__name__}"
                )
        return
    _validate_token_ids("prompt", prompt, vocab_size, None, allow_empty=False)


def _check_prompt_bytes(prompt: Prompt, max_context: int) -> None:
    """Text is bounded before it is tokenized: see PROMPT_BYTES_PER_TOKEN."""
    limit = max_prompt_bytes(max_context)
    if isinstance(prompt, str):
        what, size = "text prompt is", utf8_length(prompt, limit)
    elif prompt and isinstance(prompt[0], dict):
        what, size = "messages' contents are", 0
        for message in prompt:
            size += utf8_length(message["content"], limit - size)  # type: ignore[index]
    else:
        return
    if size > limit:
        raise ContextLengthError(
            f"{what} over {limit} bytes: at most {PROMPT_BYTES_PER_TOKEN} bytes per token of the "
            f"context of {max_context} tokens are allowed"
        )


def _validate_token_ids(
    name: str, ids: object, vocab_size: int | None, max_count: int | None, *, allow_empty: bool
) -> None:
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    if not ids and not allow_empty:
        raise InvalidRequestError(f"{name} is empty")
    if max_count is not None and len(ids) > max_count:
        raise InvalidRequestError(f"{name} has {len(ids)} entries; at most {max_count} are allowed")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidRequestError(f"{name}[{i}] must be an integer token id, got {type(t).__name__}")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            upper = f"{vocab_size - 1}" if vocab_size is not None else "vocab_size - 1"
            raise InvalidRequestError(f"{name}[{i}] = {t} is not a token id (0 .. {upper})")


def _validate_stop(stop: object) -> None:
    if not isinstance(stop, (list, tuple)):
        raise InvalidRequestError(f"stop must be a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(f"stop[{i}] must be a non-empty string")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"stop[{i}] is {len(s)} characters long; at most {MAX_STOP_STRING_CHARS}"
            )

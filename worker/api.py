"""The engine's request and result types, independent of any wire format.

The gRPC server (`cluster/convert.py`), the CLI client and the HTTP front door translate to and from these;
every list of sampling or usage fields elsewhere is derived from the dataclasses here. Needs no torch, so
that clients import it cheaply. A request is validated whole before any work is done."""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .constraints.spec import OutputConstraint
from .errors import ContextLengthError, InvalidRequestError, quoted

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


def _check_real(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    """Raise InvalidRequestError unless `value` is a finite real in [low, high] (or (low, high])."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {type(value).__name__}")
    left = "(" if low_open else "["
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        raise InvalidRequestError(f"{name} must be in {left}{low}, {high}], got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens. temperature 0 means greedy."""

    temperature: float = field(default=1.0, metadata={"help": "0 = greedy"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens (0 or -1 = off)"})
    top_p: float = field(
        default=1.0, metadata={"help": "keep the smallest set of tokens with this much probability"}
    )
    min_p: float = field(
        default=0.0, metadata={"help": "drop tokens below this fraction of the top token's probability"}
    )
    presence_penalty: float = field(
        default=0.0, metadata={"help": "subtracted once from every generated token's logit"}
    )
    frequency_penalty: float = field(
        default=0.0, metadata={"help": "subtracted per occurrence of a generated token"}
    )
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "divides (multiplies) positive (negative) logits of seen tokens"}
    )
    seed: int | None = field(default=None, metadata={"help": "seed of the request's random generator"})
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's logit_bias

    MAX_TEMPERATURE = 100.0
    MAX_SEED = 2**63 - 1
    MAX_LOGIT_BIAS = 100.0
    MAX_LOGIT_BIAS_ENTRIES = 1024

    def validate(self, vocab_size: int | None = None) -> None:
        _check_real("temperature", self.temperature, 0.0, self.MAX_TEMPERATURE)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise InvalidRequestError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_real("min_p", self.min_p, 0.0, 1.0)
        _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer or None, got {type(self.seed).__name__}")
        if self.seed is not None and not 0 <= self.seed <= self.MAX_SEED:
            raise InvalidRequestError(f"seed must be in [0, {self.MAX_SEED}], got {self.seed}")
        self._validate_logit_bias(vocab_size)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {self.MAX_LOGIT_BIAS_ENTRIES}"
            )
        for token_id, bias in self.logit_bias:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}"
                )
            if vocab_size is not None and token_id >= vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token id {token_id} is not in the vocabulary (ids 0..{vocab_size - 1})"
                )
            _check_real(f"logit_bias[{token_id}]", bias, -self.MAX_LOGIT_BIAS, self.MAX_LOGIT_BIAS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


# The scalar sampling fields by name: what a wire request or a CLI flag sets one value of (logit_bias, a map
# of token ids on every wire, is converted on its own).
SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams) if f.name != "logit_bias")


def _set_type(hint: Any) -> type:
    """The type a field's value has when it is set (`int` for `int | None`)."""
    return next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))


# What each of those fields takes (int or float), for the parsers of CLI flags and request bodies.
SAMPLING_FIELD_TYPES: dict[str, type] = {
    name: _set_type(hint)
    for name, hint in typing.get_type_hints(SamplingParams).items()
    if name in SAMPLING_FIELDS
}


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
    constraint: OutputConstraint | None = None  # the output must match it (worker/constraints/)

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
        if self.constraint is not None:
            self.constraint.validate()

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
    # The whole check in C (a 30K-token prompt is validated by the router and again by the card, on the way to
    # its first token); the loop below runs only to name the first bad entry.
    if (
        ids
        and set(map(type, ids)) == {int}
        and min(ids) >= 0
        and (vocab_size is None or max(ids) < vocab_size)
    ):
        return
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


FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass
class TokenChunk:
    """Tokens accepted since the last chunk and the text they complete (whole UTF-8 characters)."""

    token_ids: list[int]
    text: str


@dataclass
class DraftUsage:
    """Speculative counters of the cycles whose drafts came from one source (`mtp` or `lookup`)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # served from the session cache, not computed
    generated_tokens: int = 0
    drafts: int = 0  # speculative verify cycles
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # index 0 = first draft
    by_source: dict[str, DraftUsage] = field(default_factory=dict)  # the same, by draft source

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Timings:
    prefill_s: float = 0.0  # restoring cached state + computing the rest of the prompt + choosing token one
    time_to_first_token_s: float = 0.0  # from the start of the request to the first token
    decode_s: float = 0.0  # from the first token to the end
    total_s: float = 0.0
    # Gaps between consecutive chunks (a speculative cycle streams several tokens in one chunk, as vLLM
    # counts iterations); the first token's latency is time_to_first_token_s.
    inter_token_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: Usage
    timings: Timings
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any

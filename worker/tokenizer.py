"""The tokenizer of a checkpoint directory: `tokenizer.json`, its chat template and EOS ids.

`tokenizer.json` is run by the `tokenizers` library; the chat template (a jinja2 program from
the checkpoint, so untrusted) is rendered in a sandbox the way transformers renders it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from .errors import CheckpointError, InvalidRequestError, quoted
from .segment_encoding import SegmentEncoder

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
DEFAULT_TEMPLATE_NAME = "default"
MAX_PARTIAL_TOKENS = 3
MAX_HELD_TOKENS = 8
PREFIX_CACHE_SIZE = 4096
CHARS_PER_TOKEN_GUESS = 4  # first prefix `encode_at_most` tries, per token of the limit
PREFIX_CUT_SLACK_TOKENS = 64
# Texts at least this long are encoded a segment at a time, the segments remembered (segment_encoding.py): below
# it an encode costs less than splitting the text does.
SEGMENT_TEXT_CHARS = 4096


class Tokenizer:
    """Encode, decode, chat templates and end-of-sequence ids of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_templates = dict(chat_templates or {})
        self.special_tokens = dict(special_tokens or {})
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._compiled: dict[str, jinja2.Template] = {}
        self._token_texts: list[str] | None = None
        self._ids_by_prefix: dict[str, list[int]] = {}
        self._segments = SegmentEncoder(backend)

    # ---- vocabulary ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer can produce, added tokens included (the model's may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token) if self.pad_token else None

    # ---- text <-> ids --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False, memo_scope: str | None = None) -> list[int]:
        """The ids of `text`. With `memo_scope` (a request's prefix-sharing scope), a long text is encoded a
        segment at a time, the segments remembered for that scope (segment_encoding.py)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        if memo_scope is not None and not add_special_tokens and len(text) >= SEGMENT_TEXT_CHARS:
            return self._segments.encode(text, memo_scope)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_at_most(self, text: str, limit: int, memo_scope: str | None = None) -> list[int] | None:
        """`encode(text)`, or None as soon as it is clear that `text` has more than `limit` tokens: the
        work is bounded by the limit, not by the text (a 20 MB prompt for a 2k context costs a few KiB).

        Growing prefixes are encoded; a prefix cut mid-word may tokenize into a few more tokens than the
        same span of the whole text, hence the slack before a prefix's count proves the text too long."""
        chars = max(CHARS_PER_TOKEN_GUESS * (limit + 1), 1024)
        while chars < len(text):
            if len(self.encode(text[:chars])) > limit + PREFIX_CUT_SLACK_TOKENS:
                return None
            chars *= 2
        ids = self.encode(text, memo_scope=memo_scope)
        return ids if len(ids) <= limit else None

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    def token_texts(self) -> list[str]:
        """The text of every id on its own (a partial UTF-8 character shows as U+FFFD), computed once."""
        if self._token_texts is None:
            ids = [[i] for i in range(self.vocab_size)]
            self._token_texts = self.backend.decode_batch(ids, skip_special_tokens=False)
        return self._token_texts

    def added_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens (special tokens and the like): never part of healed text."""
        return frozenset(self.backend.get_added_tokens_decoder())

    def ids_starting_with(self, prefix: str) -> list[int]:
        """Ids of the ordinary (not added) tokens whose text starts with `prefix`; remembered per prefix (a
        scan of a 248k vocabulary takes tens of milliseconds)."""
        found = self._ids_by_prefix.get(prefix)
        if found is None:
            added = self.added_token_ids()
            texts = self.token_texts()
            found = [i for i, text in enumerate(texts) if text.startswith(prefix) and i not in added]
            if len(self._ids_by_prefix) >= PREFIX_CACHE_SIZE:
                self._ids_by_prefix.clear()
            self._ids_by_prefix[prefix] = found
        return found

    # ---- chat ----------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        template_name: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render chat messages (a list of {role, content}) into the model's prompt text."""
        validate_messages(messages)
        return self.render_chat(
            messages, add_generation_prompt, template_name=template_name, **template_kwargs
        )

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        template_name: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """`apply_chat_template` for messages the caller checked: they may carry what templates read
        beyond role and content (`tool_calls`, `tool_call_id`, `reasoning_content`; content None)."""
        template = self._template(template_name)
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "tools": None,  # as transformers passes them: templates test `tools is not none`
            "documents": None,
            **template_kwargs,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**context)
        except (jinja2.TemplateError, TypeError, ValueError) as e:  # a template's own checks, or bad types
            raise InvalidRequestError(f"messages: the chat template rejected them: {e}") from e

    def _template(self, name: str | None) -> jinja2.Template:
        if not self.chat_templates:
            raise InvalidRequestError("messages: this model has no chat template; send a text prompt")
        if name is None:
            name = (
                DEFAULT_TEMPLATE_NAME
                if DEFAULT_TEMPLATE_NAME in self.chat_templates
                else next(iter(self.chat_templates))
            )
        if name not in self.chat_templates:
            raise InvalidRequestError(
                f"chat template {name!r} does not exist; have {sorted(self.chat_templates)}"
            )
        if name not in self._compiled:
            try:
                self._compiled[name] = _chat_environment().from_string(self.chat_templates[name])
            except jinja2.TemplateSyntaxError as e:
                raise CheckpointError(f"chat template {name!r} is not valid jinja2: {e}") from e
        return self._compiled[name]


def validate_messages(messages: object) -> None:
    """Raise InvalidRequestError naming the first bad message: a list of {role, content: str}."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"messages[{i}] must be an object with role and content, got {type(message).__name__}"
            )
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {quoted(role)}"
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string, got {type(content).__name__}")


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # As transformers renders chat templates: sandboxed, trim_blocks + lstrip_blocks, loop controls,
    # raise_exception(), strftime_now(), and a tojson that does not HTML-escape.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas that are always complete UTF-8 characters.

    Byte-level BPE splits one character (emoji, CJK) over several tokens; decoding a prefix of
    them yields U+FFFD. The decoder keeps a window of recent ids, decodes it whole, and emits
    what extends the previous text up to the last token that ends a whole character.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []  # ids from the start of the window
        self._emitted = 0  # how many of them are already emitted as text

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        self._ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        pending = len(self._ids) - self._emitted
        if pending == 0:
            return ""
        prefix = self._decode(self._ids[: self._emitted])
        # Emit up to the last token boundary that ends on a whole character: a partial UTF-8
        # character is at most 3 bytes, so it never spans more than the last 3 tokens.
        for held in range(min(MAX_PARTIAL_TOKENS, pending - 1) + 1):
            end = len(self._ids) - held
            text = self._decode(self._ids[:end])
            if not text.endswith("\ufffd"):
                return self._advance(prefix, text, end)
        if pending > MAX_HELD_TOKENS:  # U+FFFD is the model's real output (invalid bytes): let it out
            return self._advance(prefix, self._decode(self._ids), len(self._ids))
        return ""

    def _advance(self, prefix: str, text: str, end: int) -> str:
        if len(text) < len(prefix) or (len(text) == len(prefix) and text != prefix):
            return ""  # the decode is not settled yet: wait for more tokens
        # Keep the ids emitted last time as context for the next decode; drop older ones.
        self._ids, self._emitted = self._ids[self._emitted :], end - self._emitted
        return text[len(prefix) :]

    def flush(self) -> str:
        """Return whatever is held back (incomplete bytes become U+FFFD) and reset."""
        prefix = self._decode(self._ids[: self._emitted])
        text = self._decode(self._ids)
        self._ids, self._emitted = [], 0
        return text[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


# ---- token healing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenHealing:
    """A prompt backed off by its last token, whose text the first generated token must start with.

    A prompt that ends inside what training text tokenizes as one token (`def f():` where the corpus has
    `):\n`) leaves the model at a token boundary it has rarely seen. Backing off the last token and letting
    the model choose any token that starts with its text puts the boundary back where the model expects it.
    """

    prompt_ids: list[int]
    prefix: str
    allowed_ids: list[int]


def heal_prompt(tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> TokenHealing | None:
    """The healing of `prompt_ids`, or None when its last token is the only token starting with its text
    (nothing to heal), is an added/special token, is a partial character, or is the whole prompt."""
    if len(prompt_ids) < 2:
        return None
    texts = tokenizer.token_texts()
    last = prompt_ids[-1]
    if last in tokenizer.added_token_ids() or not 0 <= last < len(texts):
        return None
    prefix = texts[last]
    if not prefix or "\ufffd" in prefix:
        return None
    allowed = tokenizer.ids_starting_with(prefix)
    if allowed == [last]:
        return None
    return TokenHealing(list(prompt_ids[:-1]), prefix, allowed)


class HealedTextDecoder:
    """Wraps a text decoder and drops the healed prefix (already part of the prompt) from its output."""

    def __init__(self, inner: IncrementalDecoder, prefix: str) -> None:
        self._inner = inner
        self._to_drop = prefix

    def push(self, token_ids: int | Iterable[int]) -> str:
        return self._drop(self._inner.push(token_ids))

    def flush(self) -> str:
        return self._drop(self._inner.flush())

    def _drop(self, text: str) -> str:
        # the first generated token starts with the prefix, so the text does too
        cut = min(len(self._to_drop), len(text))
        self._to_drop = self._to_drop[cut:]
        return text[cut:]


# ---- loading -----------------------------------------------------------------------------------


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory (tokenizer.json, tokenizer_config.json, ...)."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no tokenizer.json")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a plain Exception on malformed files
        raise CheckpointError(f"{path}: cannot be read as a tokenizers file ({e})") from e
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    special = {
        key: _token_content(tokenizer_config.get(key))
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    for key, token in special.items():
        if token is not None and backend.token_to_id(token) is None:
            raise CheckpointError(
                f"tokenizer_config.json: {key} {token!r} is not in tokenizer.json's vocabulary"
            )
    return Tokenizer(
        backend,
        chat_templates=_chat_templates(model_dir, tokenizer_config),
        special_tokens=special,
        eos_token_ids=_eos_token_ids(model_dir, backend, special["eos_token"]),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return value


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_templates(model_dir: Path, tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """Named chat templates; `chat_template.jinja` and `additional_chat_templates/` win, as in transformers."""
    templates: dict[str, str] = {}
    raw = tokenizer_config.get("chat_template")
    if isinstance(raw, str):
        templates[DEFAULT_TEMPLATE_NAME] = raw
    elif isinstance(raw, list):
        for i, entry in enumerate(raw):
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise CheckpointError(
                    f"tokenizer_config.json: chat_template[{i}] is not a {{name, template}} object"
                )
            templates[entry["name"]] = entry["template"]
    elif raw is not None:
        raise CheckpointError(
            "tokenizer_config.json: chat_template must be a string or a list of {name, template}"
        )
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        templates[DEFAULT_TEMPLATE_NAME] = template_file.read_text(encoding="utf-8")
    for extra in sorted((model_dir / "additional_chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text(encoding="utf-8")
    return templates


def _eos_token_ids(model_dir: Path, backend: tokenizers.Tokenizer, eos_token: str | None) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else config.json's (text_config's), else the eos_token."""
    for file_name in ("generation_config.json", "config.json"):
        raw = _read_json(model_dir / file_name)
        value = raw.get("eos_token_id")
        if value is None and isinstance(raw.get("text_config"), dict):
            value = raw["text_config"].get("eos_token_id")
        if value is not None:
            ids = value if isinstance(value, list) else [value]
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise CheckpointError(
                    f"{file_name}: eos_token_id must be an integer or a list of integers, got {value!r}"
                )
            return tuple(ids)
    if eos_token is not None:
        token_id = backend.token_to_id(eos_token)
        if token_id is not None:
            return (token_id,)
    return ()

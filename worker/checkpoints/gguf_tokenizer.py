"""The tokenizer a GGUF carries in its metadata (llama.cpp's `gpt2` BPE: tokens, merges, token types, the
`tokenizer.ggml.pre` split regex, special token ids, chat template), as a `tokenizers` tokenizer, and the
same metadata from one of ours for writing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import tokenizers
from gguf import TokenType
from tokenizers import decoders, models, pre_tokenizers

from ..errors import CheckpointError
from ..tokenizer import DEFAULT_TEMPLATE_NAME, Tokenizer

# tokenizer.ggml.pre -> the split regex of its tokenizer.json (None: GPT-2's, built into ByteLevel)
SPLIT_REGEXES: dict[str, str | None] = {
    "gpt2": None,
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "qwen35": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
# Turn-ending tokens llama.cpp recognises by their text (an HF config may list several EOS ids; a GGUF one).
END_OF_TURN_TEXTS = ("<|im_end|>", "<|endoftext|>")
PAD_TOKEN_FORMAT = "[PAD{}]"  # what llama.cpp's converter fills a vocabulary up to the embedding's rows with
SPECIAL_ID_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}


@dataclass
class TokenizerMetadata:
    """The tokenizer fields of a GGUF, as plain values."""

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int] = field(default_factory=dict)  # bos_token/eos_token/pad_token/unk_token -> id
    chat_template: str | None = None
    add_bos: bool = False


def build_tokenizer(meta: TokenizerMetadata, source: str) -> Tokenizer:
    """Our Tokenizer from GGUF tokenizer metadata; `source` names the file in errors."""
    if meta.model != "gpt2":
        raise CheckpointError(
            f"{source}: tokenizer.ggml.model {meta.model!r} is not supported (only 'gpt2' byte-level BPE); "
            "pass --tokenizer DIR with the model's Hugging Face tokenizer"
        )
    if meta.pre not in SPLIT_REGEXES:
        raise CheckpointError(
            f"{source}: tokenizer.ggml.pre {meta.pre!r} is not one this loader knows ({sorted(SPLIT_REGEXES)}); "
            "pass --tokenizer DIR with the model's Hugging Face tokenizer"
        )
    if len(meta.token_types) != len(meta.tokens):
        raise CheckpointError(
            f"{source}: tokenizer.ggml.token_type has {len(meta.token_types)} entries for {len(meta.tokens)} tokens"
        )
    vocab = {}
    added = []
    for token_id, (token, kind) in enumerate(zip(meta.tokens, meta.token_types, strict=True)):
        if kind == TokenType.UNUSED:
            continue  # padding rows of the embedding: no text maps to them
        vocab[token] = token_id
        if kind in (TokenType.CONTROL, TokenType.USER_DEFINED):
            added.append(tokenizers.AddedToken(token, special=kind == TokenType.CONTROL, normalized=False))
    merges = []
    for i, merge in enumerate(meta.merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{source}: tokenizer.ggml.merges[{i}] {merge!r} is not two tokens")
        merges.append((parts[0], parts[1]))
    try:
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    except Exception as e:  # the Rust side raises plain Exceptions (a merge of unknown tokens)
        raise CheckpointError(f"{source}: the tokenizer metadata does not make a BPE tokenizer ({e})") from e
    regex = SPLIT_REGEXES[meta.pre]
    if regex is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(added)
    special = {}
    for key, token_id in meta.special_ids.items():
        if not 0 <= token_id < len(meta.tokens):
            raise CheckpointError(
                f"{source}: {SPECIAL_ID_KEYS[key]} {token_id} is outside the {len(meta.tokens)} tokens"
            )
        special[key] = meta.tokens[token_id]
    eos_ids = [meta.special_ids["eos_token"]] if "eos_token" in meta.special_ids else []
    eos_ids += [
        i
        for i, (token, kind) in enumerate(zip(meta.tokens, meta.token_types, strict=True))
        if token in END_OF_TURN_TEXTS and kind == TokenType.CONTROL
    ]
    templates = {DEFAULT_TEMPLATE_NAME: meta.chat_template} if meta.chat_template else {}
    return Tokenizer(backend, chat_templates=templates, special_tokens=special, eos_token_ids=eos_ids)


def tokenizer_metadata(tokenizer: Tokenizer, vocab_size: int) -> TokenizerMetadata:
    """GGUF tokenizer metadata for one of our (Hugging Face) tokenizers, padded to the embedding's rows."""
    raw = json.loads(tokenizer.backend.to_str())
    model = raw.get("model") or {}
    if model.get("type") != "BPE" or (raw.get("decoder") or {}).get("type") != "ByteLevel":
        raise CheckpointError("only byte-level BPE tokenizers can be written to a GGUF")
    pre = _pre_name(raw.get("pre_tokenizer") or {})
    inverse = {token_id: token for token, token_id in model["vocab"].items()}
    added = {entry["id"]: entry for entry in raw.get("added_tokens") or []}
    size = max([vocab_size, *[i + 1 for i in inverse], *[i + 1 for i in added]])
    tokens, types = [], []
    for token_id in range(size):
        if token_id in added:
            tokens.append(added[token_id]["content"])
            types.append(TokenType.CONTROL if added[token_id].get("special") else TokenType.USER_DEFINED)
        elif token_id in inverse:
            tokens.append(inverse[token_id])
            types.append(TokenType.NORMAL)
        else:
            tokens.append(PAD_TOKEN_FORMAT.format(token_id))
            types.append(TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    special_ids = {}
    for key in SPECIAL_ID_KEYS:
        text = tokenizer.special_tokens.get(key)
        if text is not None and tokenizer.token_to_id(text) is not None:
            special_ids[key] = int(tokenizer.token_to_id(text))  # type: ignore[arg-type]
    if tokenizer.eos_token_ids:  # the first of the model's EOS ids (the chat turn's end for Qwen)
        special_ids["eos_token"] = tokenizer.eos_token_ids[0]
    template = tokenizer.chat_templates.get(DEFAULT_TEMPLATE_NAME) or next(
        iter(tokenizer.chat_templates.values()), None
    )
    return TokenizerMetadata("gpt2", pre, tokens, [int(t) for t in types], merges, special_ids, template)


def _pre_name(pre: Mapping[str, Any]) -> str:
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt2"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if steps and len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel":
        regex = (steps[0].get("pattern") or {}).get("Regex")
        for name, known in SPLIT_REGEXES.items():
            if known is not None and regex == known:
                return name
    raise CheckpointError(
        f"the tokenizer's pre-tokenizer {json.dumps(pre)[:200]} is none that GGUF's tokenizer.ggml.pre names "
        f"({sorted(SPLIT_REGEXES)})"
    )

"""What the engine holds per constrained request: the grammar's state and the mask it puts on the logits.

Speculative decoding is off for a constrained request (worker/engine.py): a draft's mask depends on the
drafts before it, known on the host only after the cycle's one synchronisation, so each token is chosen
on its own and masked before it is sampled (or taken greedily), which keeps the output distribution the
masked one exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import numpy as np
import torch

from ..tokenizer import Tokenizer
from .grammar import FREE, Grammar
from .json_grammar import JsonValue
from .masks import MaskCache, Vocabulary
from .spec import JSON_OBJECT, OutputConstraint
from .tool_grammar import JsonToolCall, XmlToolCall


@lru_cache(maxsize=256)
def grammar_for(constraint: OutputConstraint) -> Grammar:
    if constraint.kind == JSON_OBJECT:
        return JsonValue(frozenset({"object"}), leading_whitespace=False)
    tools = {tool.name: tool.schema() for tool in constraint.tools}
    name = constraint.tool_name or None
    form = XmlToolCall if constraint.tool_format == "xml" else JsonToolCall
    return form(tools, name, constraint.parallel_calls)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character each byte is spelled with in the vocabulary."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(tokenizer: Tokenizer) -> list[bytes | None]:
    """Every token's bytes; None for special tokens and for tokens whose bytes cannot be known (a
    non-byte-level vocabulary's partial characters)."""
    added = tokenizer.backend.get_added_tokens_decoder()
    byte_level = _is_byte_level(tokenizer)
    decoder = _byte_decoder()
    out: list[bytes | None] = []
    for token_id, text in enumerate(tokenizer.token_texts()):
        token = added.get(token_id)
        if token is not None:
            out.append(None if token.special else token.content.encode())
            continue
        piece = tokenizer.id_to_token(token_id) if byte_level else None
        if piece is not None and all(c in decoder for c in piece):
            out.append(bytes(decoder[c] for c in piece))
        elif "\ufffd" not in text:
            out.append(text.encode())
        else:
            out.append(None)
    return out


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    decoder = tokenizer.backend.decoder
    return decoder is not None and type(decoder).__name__ == "ByteLevel"


class Constraints:
    """One engine's constraint machinery: its vocabulary's bytes and the masks cached across requests."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.masks = MaskCache(Vocabulary(token_bytes(tokenizer)))

    def begin(self, constraint: OutputConstraint, end_ids: Iterable[int]) -> TokenConstraint:
        return TokenConstraint(grammar_for(constraint), self.masks, end_ids)


class TokenConstraint:
    """`mask(logits)` before each token is chosen, `advance(tokens)` after; once the grammar is FREE
    both are no-ops."""

    def __init__(self, grammar: Grammar, masks: MaskCache, end_ids: Iterable[int]) -> None:
        self.grammar = grammar
        self.masks = masks
        self.state = grammar.start()
        self.end_ids = sorted(i for i in end_ids if 0 <= i < masks.vocabulary.size)

    @property
    def free(self) -> bool:
        return self.state == FREE

    def allowed(self) -> np.ndarray | None:
        """Bool [vocabulary]: the tokens that may come next (None: any)."""
        if self.free:
            return None
        allowed = self.masks.mask(self.grammar, self.state)
        if self.grammar.accepts(self.state) or not allowed.any():
            # Complete; or the vocabulary cannot spell any way on, and ending beats breaking the grammar.
            allowed = allowed.copy()
            allowed[self.end_ids] = True
        return allowed if allowed.any() else None  # no token at all: unmasked rather than undefined

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [T, V] with every token the grammar does not allow next at -inf (all rows alike)."""
        allowed = self.allowed()
        if allowed is None:
            return logits
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        size = min(len(allowed), logits.shape[-1])
        keep[:size] = torch.from_numpy(allowed[:size])
        return logits.masked_fill(~keep.to(logits.device), float("-inf"))

    def advance(self, token_ids: Iterable[int]) -> None:
        vocabulary = self.masks.vocabulary
        for token_id in token_ids:
            if self.free or token_id in self.end_ids or not 0 <= token_id < vocabulary.size:
                continue
            state = self.grammar.advance(self.state, vocabulary.token(token_id))
            if state is None:  # only a token the mask let through is ever taken
                raise RuntimeError(f"token {token_id} breaks the constraint it was chosen under")
            self.state = state

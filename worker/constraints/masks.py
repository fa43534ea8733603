"""Token masks: which of the vocabulary's tokens a grammar allows next, from its state.

Each token is its bytes (what it adds to the output); the mask of a state walks every token through the
grammar at once, grouping tokens by the state their bytes so far lead to, so each state along the way is
stepped once per distinct next byte, and a state that loops on most bytes (inside a string) skips a whole
run of them in one vector operation. Masks are cached per (grammar, state): a request's states repeat
(the same string, the same nesting) and requests share grammars.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np

from .grammar import Grammar, State

# Bytes of cached masks (one byte per token each): a few hundred states of a 248k vocabulary.
MASK_CACHE_BYTES = 64 << 20


class Vocabulary:
    """The token ids a constraint may allow and their bytes; `None` for a token that may never be chosen
    under a constraint (special tokens, tokens that add no text)."""

    def __init__(self, token_bytes: Sequence[bytes | None]) -> None:
        self.size = len(token_bytes)
        pieces = [b or b"" for b in token_bytes]
        self.lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.flat = np.frombuffer(b"".join(pieces) + b"\0", dtype=np.uint8)
        self.ids = np.flatnonzero(self.lengths > 0)
        self._skips: dict[frozenset[int], np.ndarray] = {}

    def token(self, token_id: int) -> bytes:
        start = int(self.offsets[token_id])
        return self.flat[start : start + int(self.lengths[token_id])].tobytes()

    def skip(self, loop: frozenset[int], ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Each token's position after the run of `loop` bytes that starts at `pos`."""
        next_other = self._skips.get(loop)
        if next_other is None:
            table = np.ones(256, dtype=bool)
            table[list(loop)] = False
            other = table[self.flat]
            other[-1] = True  # the sentinel
            index = np.where(other, np.arange(len(self.flat)), len(self.flat) - 1)
            next_other = self._skips[loop] = np.minimum.accumulate(index[::-1])[::-1]
        start = self.offsets[ids]
        return np.minimum(next_other[start + pos], start + self.lengths[ids]) - start


def allowed_tokens(grammar: Grammar, state: State, vocabulary: Vocabulary) -> np.ndarray:
    """Bool [vocabulary.size]: the tokens whose every byte `grammar` allows from `state` (end-of-sequence
    tokens are the caller's: they have no bytes)."""
    allowed = np.zeros(vocabulary.size, dtype=bool)
    frontier: dict[State, list[tuple[np.ndarray, np.ndarray]]] = {
        state: [(vocabulary.ids, np.zeros(len(vocabulary.ids), dtype=np.int64))]
    }
    while frontier:
        following: dict[State, list[tuple[np.ndarray, np.ndarray]]] = {}
        for current, groups in frontier.items():
            ids = np.concatenate([g[0] for g in groups])
            pos = np.concatenate([g[1] for g in groups])
            loop = grammar.loop_bytes(current)
            if loop:
                pos = vocabulary.skip(loop, ids, pos)
            ended = pos >= vocabulary.lengths[ids]
            allowed[ids[ended]] = True
            ids, pos = ids[~ended], pos[~ended]
            if not len(ids):
                continue
            following_bytes = vocabulary.flat[vocabulary.offsets[ids] + pos]
            order = np.argsort(following_bytes, kind="stable")
            ids, pos, following_bytes = ids[order], pos[order], following_bytes[order]
            values, starts = np.unique(following_bytes, return_index=True)
            ends = [*starts[1:], len(ids)]
            for byte, start, end in zip(values.tolist(), starts.tolist(), ends, strict=True):
                after = grammar.step(current, byte)
                if after is not None:
                    following.setdefault(after, []).append((ids[start:end], pos[start:end] + 1))
        frontier = following
    return allowed


class MaskCache:
    """`allowed_tokens` remembered per (grammar key, state), least recently used first out."""

    def __init__(self, vocabulary: Vocabulary, max_bytes: int = MASK_CACHE_BYTES) -> None:
        self.vocabulary = vocabulary
        self.max_entries = max(1, max_bytes // max(vocabulary.size, 1))
        self._masks: OrderedDict[tuple[Hashable, State], np.ndarray] = OrderedDict()

    def mask(self, grammar: Grammar, state: State) -> np.ndarray:
        key = (grammar.key, state)
        mask = self._masks.get(key)
        if mask is not None:
            self._masks.move_to_end(key)
            return mask
        mask = allowed_tokens(grammar, state, self.vocabulary)
        self._masks[key] = mask
        if len(self._masks) > self.max_entries:
            self._masks.popitem(last=False)
        return mask

"""Encoding a long text a segment at a time, the segments between added tokens remembered.

Agents send the whole conversation every turn, so a card renders and encodes a chat prompt of tens of thousands
of tokens per turn, though all but its last messages were encoded the turn before (30K tokens take about 29 ms
on the 2-core development machine: tools/encode_turns.py). The tokenizer cuts its input at added tokens
(`<|im_start|>`, `<|im_end|>`, ...) before anything else and encodes the pieces in between one by one, so the
ids of a text are its pieces' ids in order, and a piece encoded before need not be encoded again.

Remembered segments are kept apart by scope (the request's prefix-sharing scope, worker/prefixes.py): how fast a
prompt encodes must not tell a user whether another user sent the same text, as with the shared prefixes.

That holds only where an added token cannot change the encoding around it: the memo is off for a tokenizer with
an added token that strips neighbouring spaces, matches only whole words or is matched after normalisation, and
for one set to encode special tokens as text.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict

import tokenizers

MEMO_CHARS = 8 << 20  # the remembered segments' total size, least recently used out first


class SegmentEncoder:
    """`encode(text, scope)`: the ids `backend.encode(text, add_special_tokens=False)` gives, from the segments
    remembered for `scope`."""

    def __init__(self, backend: tokenizers.Tokenizer, memo_chars: int = MEMO_CHARS) -> None:
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        self.usable = (
            bool(added)
            and not getattr(backend, "encode_special_tokens", False)
            and not any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values())
        )
        self._ids = {token.content: token_id for token_id, token in added.items()}
        # Longest first: at one position the regex takes the first alternative, the tokenizer the longest match.
        contents = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(c) for c in contents) + ")") if contents else None
        # (scope, segment) -> ids: 4 bytes a token, not a list's 36
        self._memo: OrderedDict[tuple[str, str], array[int]] = OrderedDict()
        self._chars = 0
        self._memo_chars = memo_chars
        self._lock = threading.Lock()

    def encode(self, text: str, scope: str) -> list[int]:
        if not self.usable or self._split is None:
            return self.backend.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:  # an added token (re.split puts the separators at odd places)
                ids.append(self._ids[part])
            elif part:
                ids.extend(self._segment(scope, part))
        return ids

    def _segment(self, scope: str, text: str) -> array[int]:
        key = (scope, text)
        with self._lock:
            ids = self._memo.get(key)
            if ids is not None:
                self._memo.move_to_end(key)
                return ids
        ids = array("i", self.backend.encode(text, add_special_tokens=False).ids)
        if len(text) <= self._memo_chars:
            with self._lock:
                if key not in self._memo:
                    self._memo[key] = ids
                    self._chars += len(text)
                while self._chars > self._memo_chars:
                    (_, old), _ = self._memo.popitem(last=False)
                    self._chars -= len(old)
        return ids

    @property
    def remembered_chars(self) -> int:
        return self._chars

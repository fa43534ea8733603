"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the context's last n tokens.

Agents re-emit much of their context (a file written back with an edit, a search/replace block quoting the
original lines), so the continuation of an n-gram seen before is often the continuation to come. The index
keeps, for every n-gram of the session's tokens (n_min <= n <= n_max), the position that followed its latest
occurrence: a lookup and the update per appended token are O(n_max - n_min + 1) dictionary operations, never a
scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence


class NGramIndex:
    """The tokens of one session (prompt and output) and where each of their n-grams last continued.

    Keys are the n-grams' hashes (ints: a fraction of a tuple's memory); a hash collision is caught by
    comparing the tokens at the stored position, so a lookup never proposes a continuation of another n-gram.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._next: dict[int, int] = {}  # hash of an n-gram -> position after its latest occurrence

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens. The n-grams ending just before each new token gain that token's position: the
        n-gram ending at the very end has no continuation yet, so it is indexed when the next token comes."""
        own, index = self.tokens, self._next
        for token in tokens:
            j = len(own)
            for n in range(self.n_min, min(self.n_max, j) + 1):
                index[hash(tuple(own[j - n : j]))] = j
            own.append(int(token))

    def sync(self, tokens: Sequence[int]) -> None:
        """Make the index hold exactly `tokens`: extended when they continue what it holds (a session's next
        turn), rebuilt otherwise (an edited or regenerated turn)."""
        held = len(self.tokens)
        if len(tokens) >= held and list(tokens[:held]) == self.tokens:
            self.extend(tokens[held:])
            return
        self.tokens, self._next = [], {}
        self.extend(tokens)

    def match(self, after: Sequence[int] = ()) -> tuple[int, int] | None:
        """(where the continuation of the latest earlier occurrence of the longest indexed suffix starts,
        that suffix's length); None when no suffix of n_min..n_max tokens occurred before.

        `after`: tokens taken to follow the held ones without being indexed (an MTP draft to continue): the
        suffix is that of the held tokens and `after`."""
        # Only the last n_max held tokens can be part of a suffix: no copy of the whole context.
        tail = self.tokens[-self.n_max :] + list(after) if after else self.tokens
        total = len(self.tokens) + len(after)
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            key = tail[len(tail) - n :]
            start = self._next.get(hash(tuple(key)))
            if start is not None and self.tokens[start - n : start] == key:
                return start, n
        return None

    def continuation(self, limit: int, after: Sequence[int] = ()) -> tuple[list[int], int]:
        """(up to `limit` tokens from `match`'s start, read on into `after` past the held tokens, the
        suffix's length); ([], 0) when nothing matched."""
        found = self.match(after) if limit >= 1 else None
        if found is None:
            return [], 0
        start, n = found
        copy = self.tokens[start : start + limit]
        if len(copy) < limit and after:
            copy += list(after[: limit - len(copy)])
        return copy, n

"""The router's token-prefix index: which card holds state for which prompt prefixes.

Requests without a session id (coding agents resend the whole conversation each turn and send none) and
new sessions go to the card holding the longest prefix of their prompt (cluster/policy.py). Each card
reports, with every finished turn, the points a prompt can continue from there: its anonymous sessions'
states and checkpoints and its shared prefix checkpoints (worker/prefixes.py), each with its sharing scope.
A point is indexed by the chained hash of its whole `BLOCK_TOKENS`-token blocks (as vLLM and SGLang hash
KV blocks): hash(block i) covers blocks 0..i, so one lookup per block of the prompt finds every card holding
that exact prefix. A match is an estimate, rounded down to a block: the card reuses exactly what it holds,
and reports it as the turn's cached tokens. A report replaces the card's previous one; a card that goes down
or restarts is forgotten.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BLOCK_TOKENS = 16
_SEED = b"onestream-prefix-v1"


def block_hashes(tokens: Sequence[int]) -> list[bytes]:
    """The chained hash of each whole block of `tokens`: entry i identifies tokens[: (i + 1) * BLOCK_TOKENS]."""
    whole = len(tokens) - len(tokens) % BLOCK_TOKENS
    data = array("q", tokens[:whole]).tobytes()
    step = BLOCK_TOKENS * 8
    hashes: list[bytes] = []
    previous = _SEED
    for start in range(0, len(data), step):
        previous = hashlib.blake2b(previous + data[start : start + step], digest_size=16).digest()
        hashes.append(previous)
    return hashes


def point_key(tokens: Sequence[int]) -> bytes | None:
    """The index key of a held point: the hash of its last whole block (None below one block)."""
    whole = len(tokens) - len(tokens) % BLOCK_TOKENS
    if whole == 0:
        return None
    return block_hashes(tokens[:whole])[-1]


class PointReporter:
    """Turns a card's held points into its `PrefixReport`, hashing each point once while it is held."""

    def __init__(self) -> None:
        self._keys: dict[tuple[int, ...], bytes | None] = {}

    def report(self, points: Iterable[tuple[str, Sequence[int]]]) -> PrefixReport:
        keys: dict[tuple[int, ...], bytes | None] = {}
        held: set[tuple[str, bytes]] = set()
        for scope, tokens in points:
            whole = tuple(tokens[: len(tokens) - len(tokens) % BLOCK_TOKENS])
            if whole not in keys:
                keys[whole] = self._keys[whole] if whole in self._keys else point_key(whole)
            key = keys[whole]
            if key is not None:
                held.add((scope, key))
        self._keys = keys
        return PrefixReport(tuple(sorted(held)))


class PrefixIndex:
    """Points by (scope, key), and each card's current report."""

    def __init__(self) -> None:
        self._cards_by_point: dict[tuple[str, bytes], set[str]] = {}
        self._points_of_card: dict[str, list[tuple[str, bytes]]] = {}

    def update(self, card_id: str, points: Iterable[tuple[str, bytes]]) -> None:
        """Replace what `card_id` is known to hold."""
        self.forget(card_id)
        held = list(points)
        self._points_of_card[card_id] = held
        for point in held:
            self._cards_by_point.setdefault(point, set()).add(card_id)

    def forget(self, card_id: str) -> None:
        for point in self._points_of_card.pop(card_id, []):
            cards = self._cards_by_point.get(point)
            if cards is not None:
                cards.discard(card_id)
                if not cards:
                    del self._cards_by_point[point]

    def matches(self, scope: str, tokens: Sequence[int]) -> dict[str, int]:
        """Card id -> the longest prefix of `tokens` (in tokens, whole blocks, less than the whole prompt)
        that the card holds in `scope`."""
        found: dict[str, int] = {}
        if not self._cards_by_point:
            return found
        hashes = block_hashes(tokens[: max(len(tokens) - 1, 0)])
        for i in range(len(hashes) - 1, -1, -1):
            for card_id in self._cards_by_point.get((scope, hashes[i]), ()):
                found.setdefault(card_id, (i + 1) * BLOCK_TOKENS)
        return found

    def cards(self) -> int:
        return len(self._points_of_card)

    def points(self) -> int:
        return sum(len(p) for p in self._points_of_card.values())


@dataclass(frozen=True)
class PrefixReport:
    """A card's stream item, sent just before a turn's `Finished`: every point it now holds."""

    points: tuple[tuple[str, bytes], ...]

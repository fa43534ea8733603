"""Prefix checkpoints shared across the sessions of one card, and who may share them.

A team's agents start every conversation with the same system prompt and tools. When a prefill starts from
nothing (or from a shared checkpoint) and crosses a *message boundary* (the position of a message-start
token such as `<|im_start|>`, where agent prompts diverge), the card keeps a full checkpoint there: the KV
caches up to that position, the DeltaNet conv and recurrent states and the MTP cache at it. Any later
prompt of the same sharing scope that begins with those tokens restores the deepest such checkpoint and
prefills only what follows. Boundaries closer than `MIN_PREFIX_TOKENS` to the start, and the last message's
own start (the generation prompt: the session's checkpoints cover it), are skipped. A session continuing
its own state takes none: the boundaries it crosses are its own conversation's.

Sharing is a side channel (cached-token counts and timing tell a client whether a prefix is held), so
checkpoints are shared within one user by default and across everyone only when the operator says so
(`--prefix-sharing team`). Without authentication there are no users and one scope.

Their memory counts with the session cache (worker/sessions.py evicts from both within one budget).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sequence import Checkpoint

PREFIX_SHARING_MODES = ("user", "team")
DEFAULT_PREFIX_SHARING = "user"
# Tokens that start a message in the chat templates we serve (Qwen's ChatML).
MESSAGE_START_TOKENS = ("<|im_start|>",)
# Shorter shared prefixes save less than the KV copy and the lookup cost.
MIN_PREFIX_TOKENS = 64
TEAM_SCOPE = "team"


def sharing_scope(user: str | None, sharing: str) -> str:
    """Who may reuse state a request leaves behind: its user's scope, or the team's."""
    if sharing not in PREFIX_SHARING_MODES:
        raise ValueError(f"prefix sharing must be one of {PREFIX_SHARING_MODES}, got {sharing!r}")
    if sharing == "team" or user is None:
        return TEAM_SCOPE
    return f"user:{user}"


def message_boundaries(tokens: Seq[int], markers: frozenset[int], start: int, end: int) -> list[int]:
    """Positions p in (start, end] where a message starts (tokens[p] is a marker) and p is at least
    `MIN_PREFIX_TOKENS`, less the last message's own start: the lengths of the shareable prefixes."""
    if not markers:
        return []
    first, stop = max(start + 1, MIN_PREFIX_TOKENS), min(end + 1, len(tokens))
    found = [p for p in range(first, stop) if tokens[p] in markers]
    last = next((p for p in range(len(tokens) - 1, -1, -1) if tokens[p] in markers), None)
    return [p for p in found if p != last]


@dataclass
class SharedPrefix:
    """A full checkpoint that sessions of `scope` share; `hits` counts the sessions that restored it."""

    scope: str
    checkpoint: Checkpoint
    hits: int = 0
    last_used: float = field(default_factory=time.time)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.checkpoint.tokens

    @property
    def nbytes(self) -> int:
        return self.checkpoint.nbytes


class PrefixStore:
    """The shared prefix checkpoints of one card, by scope and tokens."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, tuple[int, ...]], SharedPrefix] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[SharedPrefix]:
        return iter(list(self._entries.values()))

    def holds(self, scope: str, tokens: Seq[int]) -> bool:
        return (scope, tuple(tokens)) in self._entries

    def add(self, scope: str, checkpoint: Checkpoint) -> SharedPrefix:
        entry = SharedPrefix(scope, checkpoint)
        self._entries[(scope, checkpoint.tokens)] = entry
        return entry

    def longest(self, scope: str, prompt: Seq[int]) -> SharedPrefix | None:
        """The deepest checkpoint of `scope` whose tokens are a proper prefix of `prompt` (the last prompt
        token must still run to give the first logits)."""
        best: SharedPrefix | None = None
        for (entry_scope, tokens), entry in self._entries.items():
            if entry_scope != scope or len(tokens) >= len(prompt):
                continue
            if best is not None and len(tokens) <= len(best.tokens):
                continue
            if tuple(prompt[: len(tokens)]) == tokens:
                best = entry
        return best

    def used(self, entry: SharedPrefix) -> None:
        entry.hits += 1
        entry.last_used = time.time()

    def remove(self, entry: SharedPrefix) -> None:
        self._entries.pop((entry.scope, entry.tokens), None)

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())


REUSE_NONE, REUSE_SESSION, REUSE_CONVERSATION, REUSE_SHARED = "none", "session", "conversation", "shared"


@dataclass(frozen=True)
class PrefixReuse:
    """Where a turn's cached prompt tokens came from: nothing, its own session, an anonymous session found
    by its prompt (`conversation`: the same conversation's earlier turn, sent without a session id), or a
    shared prefix checkpoint. The last two are prefix-cache hits."""

    source: str
    tokens: int

    @property
    def by_prefix(self) -> bool:
        return self.source in (REUSE_CONVERSATION, REUSE_SHARED) and self.tokens > 0

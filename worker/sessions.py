"""The session cache: per conversation, the sequence state of its last turn and a few checkpoints.

Reuse policy for a new prompt P of a cached session:
1. P extends the tokens the state has consumed -> keep the state, prefill only the new suffix.
2. Otherwise restore the longest checkpoint whose tokens are a prefix of P (shorter than P: the last prompt
   token must still run to give the first logits) and of the tokens the state holds, and recompute the rest.
   KV caches are truncated, but DeltaNet state cannot be, so rewinding needs a checkpoint of it. Checkpoints
   hold no KV caches (O(layers x state) bytes, not O(context)): one is usable only while the state still
   holds its tokens, and those that are not a prefix of P are dropped, since running P overwrites them.
3. Otherwise start from an empty state.
Checkpoints are taken where branches usually start: the end of every turn's prompt minus its last token
(a regenerated turn restores it), and the end of the previous turn's output when a new turn extends it (an
edited last message restores it). Each session keeps at most `max_checkpoints`, least recently used dropped.

A request without a session id continues the *anonymous* session of its sharing scope that reuses the most
of its prompt (agents resend the whole conversation each turn and send no id), or starts a new one.
Prefix checkpoints shared across sessions (worker/prefixes.py) live here too, in the same budget.

Memory is bounded by bytes (states, checkpoints and their hiddens, shared prefixes). Least valuable first
out: shared prefixes no session has reused yet (the oldest first), then whatever was used least recently,
sessions and reused shared prefixes alike.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from .errors import UnknownSessionError
from .prefixes import TEAM_SCOPE, PrefixStore, SharedPrefix
from .sequence import Checkpoint, Sequence


@dataclass
class Session:
    session_id: str
    sequence: Sequence
    checkpoints: list[Checkpoint] = field(default_factory=list)  # least recently used first
    last_used: float = field(default_factory=time.time)
    closed: bool = False  # closed while in use: not cached again
    scope: str = TEAM_SCOPE  # who may continue it by prefix or share what it leaves (worker/prefixes.py)
    anonymous: bool = False  # opened by a request without a session id: found by prompt prefix

    def nbytes(self) -> int:
        return self.sequence.nbytes() + sum(c.nbytes for c in self.checkpoints)

    def add_checkpoint(self, max_checkpoints: int) -> None:
        """Checkpoint the sequence where it is now (unless one exists there), dropping the oldest beyond the cap."""
        n = len(self.sequence)
        if n == 0 or max_checkpoints < 1:
            return
        if any(len(c.tokens) == n and self.sequence.can_restore(c) for c in self.checkpoints):
            return
        self.checkpoints.append(self.sequence.checkpoint())
        del self.checkpoints[: max(0, len(self.checkpoints) - max_checkpoints)]

    def reusable_for(self, prompt: Seq[int]) -> int:
        """How many prompt tokens `rewind_for` would keep (without changing anything)."""
        tokens = self.sequence.tokens
        if len(tokens) < len(prompt) and _is_prefix(tokens, prompt):
            return len(tokens)
        return max(
            (
                len(c.tokens)
                for c in self.checkpoints
                if len(c.tokens) < len(prompt)
                and _is_prefix(c.tokens, prompt)
                and self.sequence.can_restore(c)
            ),
            default=0,
        )

    def rewind_for(self, prompt: Seq[int]) -> int:
        """Bring the sequence to the longest reusable prefix of `prompt` (see the module's policy).

        Returns how many prompt tokens are already in the state; at least one token is always left to run.
        """
        # Running the prompt overwrites the KV positions of checkpoints that are not a prefix of it.
        self.checkpoints = [c for c in self.checkpoints if _is_prefix(c.tokens, prompt)]
        tokens = self.sequence.tokens
        if len(tokens) < len(prompt) and _is_prefix(tokens, prompt):
            return len(tokens)
        usable = [c for c in self.checkpoints if len(c.tokens) < len(prompt) and self.sequence.can_restore(c)]
        if not usable:
            self.sequence.reset()
            return 0
        best = max(usable, key=lambda c: len(c.tokens))
        self.sequence.restore(best)
        self.checkpoints.remove(best)
        self.checkpoints.append(best)  # most recently used
        return len(best.tokens)


def _is_prefix(prefix: Seq[int], tokens: Seq[int]) -> bool:
    return len(prefix) <= len(tokens) and list(tokens[: len(prefix)]) == list(prefix)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    tokens: int
    checkpoints: int
    nbytes: int
    last_used: float


class SessionCache:
    """Sessions by id, least recently used first, within `max_bytes`."""

    def __init__(self, max_bytes: int, *, max_checkpoints: int = 4) -> None:
        if max_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.max_checkpoints = max_checkpoints
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._active: Session | None = None
        self.prefixes = PrefixStore()
        self.evictions = 0

    def take(self, session_id: str) -> Session | None:
        """Remove a session from the cache for the duration of a turn (put it back with `put`)."""
        session = self._sessions.pop(session_id, None)
        self._active = session
        return session

    def take_by_prefix(self, scope: str, prompt: Seq[int], *, track_mtp: bool) -> Session | None:
        """Take the anonymous session of `scope` that reuses the most of `prompt` (None if none reuses any).
        With `track_mtp`, only sessions that kept their MTP cache (the others could never draft again)."""
        best, best_reuse = None, 0
        for session in self._sessions.values():
            if session.anonymous and session.scope == scope and session.sequence.track_mtp >= track_mtp:
                reuse = session.reusable_for(prompt)
                if reuse > best_reuse:
                    best, best_reuse = session, reuse
        return self.take(best.session_id) if best is not None else None

    def begin(self, session: Session) -> None:
        """Mark a new session as the one in use (so that `close` and `list` see it)."""
        self._active = session

    def put(self, session: Session) -> None:
        """Cache a session as most recently used, evicting least recently used ones to fit the budget."""
        if self._active is session:
            self._active = None
        if session.closed:
            self._fit(None)
            return
        session.last_used = time.time()
        self._sessions[session.session_id] = session
        self._sessions.move_to_end(session.session_id)
        total = self._fit(session)
        # Alone and still too big: shed its checkpoints, then the session itself.
        while session.checkpoints and total > self.max_bytes:
            total -= session.checkpoints.pop(0).nbytes
        if total > self.max_bytes:
            self._sessions.pop(session.session_id)
            self.evictions += 1

    def add_prefix(self, scope: str, checkpoint: Checkpoint) -> None:
        """Keep a shared prefix checkpoint (the budget is enforced when the turn's session is put back)."""
        self.prefixes.add(scope, checkpoint)

    def _fit(self, keep: Session | None) -> int:
        """Evict the least valuable entries (never `keep`) until the budget holds or only `keep` is left;
        returns the bytes still held."""
        total = self.nbytes()
        while total > self.max_bytes:
            victim = self._least_valuable(keep)
            if victim is None:
                break
            if isinstance(victim, SharedPrefix):
                self.prefixes.remove(victim)
                total -= victim.nbytes
            else:
                del self._sessions[victim.session_id]
                total -= victim.nbytes()
            self.evictions += 1
        return total

    def _least_valuable(self, keep: Session | None) -> Session | SharedPrefix | None:
        unused = [p for p in self.prefixes if p.hits == 0]
        if unused:
            return min(unused, key=lambda p: p.last_used)
        candidates: list[Session | SharedPrefix] = [s for s in self._sessions.values() if s is not keep]
        candidates.extend(self.prefixes)
        return min(candidates, key=lambda c: c.last_used, default=None)

    def discard(self, session: Session) -> None:
        """Forget a session that is in use (its state may be inconsistent after an error)."""
        if self._active is session:
            self._active = None
        self._sessions.pop(session.session_id, None)

    def close(self, session_id: str) -> None:
        if session_id in self._sessions:
            del self._sessions[session_id]
        elif self._active is not None and self._active.session_id == session_id and not self._active.closed:
            self._active.closed = True
        else:
            raise UnknownSessionError(f"no cached session {session_id!r}")

    def prefix_points(self) -> list[tuple[str, tuple[int, ...]]]:
        """(scope, tokens) of each point a request without a session id can continue from."""
        points = [(p.scope, p.tokens) for p in self.prefixes]
        for session in self._sessions.values():
            if session.anonymous:
                points.append((session.scope, tuple(session.sequence.tokens)))
                points.extend((session.scope, c.tokens) for c in session.checkpoints)
        return points

    def list(self) -> list[SessionInfo]:
        sessions = list(self._sessions.values())
        if self._active is not None and not self._active.closed:
            sessions.append(self._active)
        return [
            SessionInfo(s.session_id, len(s.sequence), len(s.checkpoints), s.nbytes(), s.last_used)
            for s in sessions
        ]

    def nbytes(self) -> int:
        """Bytes held by the cached sessions (not the one in use) and the shared prefixes."""
        return self.session_nbytes() + self.prefixes.nbytes()

    def session_nbytes(self) -> int:
        return sum(s.nbytes() for s in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

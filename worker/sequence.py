"""One sequence driven by a back end: its state, the tokens it has consumed, and the MTP head kept in step.

The MTP head at position p consumes the pair (token t[p+1], main hidden H[p]). The pairs completed by running
tokens through the main model are queued (the backlog) and run together with the next first draft step, so
the MTP cache holds every consumed position without an extra MTP call per cycle.

Invariant (when MTP is tracked and the sequence is not empty):
    state.mtp_length + len(backlog) == len(tokens) - 1, and `last_hidden` is H[len(tokens) - 1].
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from .backend import Backend, StepOutput

# Tokens per forward call when running a prompt or an MTP backlog: bounds the T x T attention scores and
# the T x V logits (the model returns logits for every row).
MAX_TOKENS_PER_CALL = 512


@dataclass
class Checkpoint:
    """A restorable point of a sequence: its first `len(tokens)` tokens and the state after them."""

    tokens: tuple[int, ...]
    snapshot: Any
    last_hidden: torch.Tensor | None
    nbytes: int


class Sequence:
    """The state of one sequence and the operations the engine loop needs on it."""

    def __init__(self, backend: Backend, max_len: int, *, track_mtp: bool) -> None:
        self.backend = backend
        self.max_len = max_len
        self.state = backend.new_state(max_len)
        self.tokens: list[int] = []
        self.track_mtp = track_mtp and backend.has_mtp
        self.last_hidden: torch.Tensor | None = None
        self._backlog_tokens: list[int] = []
        self._backlog_hidden: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        owed = sum(h.numel() * h.element_size() for h in self._backlog_hidden)
        return self.backend.nbytes(self.state) + owed

    def release_rollback_records(self) -> None:
        """Drop what the last verify kept for rollback (before the sequence is parked in a cache)."""
        self.backend.release(self.state)

    def _ids(self, tokens: Seq[int]) -> torch.Tensor:
        return torch.tensor(list(tokens), dtype=torch.long, device=self.backend.device)

    def _owe_mtp(self, tokens: Seq[int], hidden: torch.Tensor) -> None:
        """Queue the MTP pairs completed by running `tokens` whose hiddens are `hidden` [T, H]."""
        if not self.track_mtp:
            return
        if self.last_hidden is None:  # first tokens of the sequence: t[0] pairs with nothing
            tokens, previous = tokens[1:], hidden[:-1]
        else:
            previous = torch.cat([self.last_hidden.unsqueeze(0), hidden[:-1]])
        if len(tokens):
            self._backlog_tokens.extend(tokens)
            self._backlog_hidden.append(previous)

    # ---- running tokens ---------------------------------------------------------------------------
    def feed(self, tokens: Seq[int]) -> StepOutput:
        """Run `tokens` (a prompt or one decoded token) through the main model, in chunks; returns the
        last chunk's output."""
        out = None
        for start in range(0, len(tokens), MAX_TOKENS_PER_CALL):
            piece = tokens[start : start + MAX_TOKENS_PER_CALL]
            ids = self._ids(piece)
            if len(piece) > 1:
                out = self.backend.prefill(ids, self.state)
            else:
                out = self.backend.decode(ids, self.state)
            self._owe_mtp(piece, out.hidden)
            self.tokens.extend(piece)
            self.last_hidden = out.hidden[-1]
        assert out is not None
        return out

    def run_verify(self, inputs: Seq[int]) -> StepOutput:
        """Run [pending, d1..dk] keeping every position reachable; `accept_verified` then commits."""
        return self.backend.decode(self._ids(inputs), self.state, keep_states=True)

    def accept_verified(self, inputs: Seq[int], verify: StepOutput, kept: int) -> None:
        """Keep the first `kept` verified inputs in the state (roll back the rest).

        `draft_first` already gave the MTP cache the pair of inputs[0]; the kept drafts' pairs are owed."""
        self.backend.rollback(self.state, len(inputs) - kept)
        if kept > 1:
            self._backlog_tokens.extend(inputs[1:kept])
            self._backlog_hidden.append(verify.hidden[: kept - 1])
        self.tokens.extend(inputs[:kept])
        self.last_hidden = verify.hidden[kept - 1]

    # ---- MTP drafting -------------------------------------------------------------------------------
    def draft_first(self, pending: int) -> StepOutput:
        """First draft step after `pending` (the emitted token not yet run): runs the owed MTP pairs and
        (pending, H[last]) together; the last row's logits draft the token after `pending`."""
        assert self.track_mtp and self.last_hidden is not None
        tokens = [*self._backlog_tokens, pending]
        hidden = torch.cat([*self._backlog_hidden, self.last_hidden.unsqueeze(0)])
        self._backlog_tokens, self._backlog_hidden = [], []
        return self._run_mtp(tokens, hidden)

    def draft_next(self, token: int, mtp_hidden: torch.Tensor) -> StepOutput:
        """A further draft step: the previous draft with the MTP layer's own output."""
        return self.backend.draft(self._ids([token]), mtp_hidden, self.state)

    def drop_draft_positions(self, n: int) -> None:
        """Forget the MTP positions written by draft steps after the first (their hiddens were drafts')."""
        self.backend.rollback_draft(self.state, n)

    def flush_mtp(self) -> None:
        """Run the owed MTP pairs now (before a snapshot, so that the snapshot's MTP cache is complete)."""
        if self._backlog_tokens:
            self._run_mtp(self._backlog_tokens, torch.cat(self._backlog_hidden))
            self._backlog_tokens, self._backlog_hidden = [], []

    def _run_mtp(self, tokens: Seq[int], hidden: torch.Tensor) -> StepOutput:
        """MTP pairs in chunks (a whole prompt's backlog would make T x T attention scores)."""
        out = None
        for start in range(0, len(tokens), MAX_TOKENS_PER_CALL):
            end = start + MAX_TOKENS_PER_CALL
            out = self.backend.draft(self._ids(tokens[start:end]), hidden[start:end], self.state)
        assert out is not None
        return out

    # ---- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        self.flush_mtp()
        snapshot = self.backend.snapshot(self.state)
        last = self.last_hidden.clone() if self.last_hidden is not None else None
        hidden_bytes = last.numel() * last.element_size() if last is not None else 0
        return Checkpoint(tuple(self.tokens), snapshot, last, self.backend.nbytes(snapshot) + hidden_bytes)

    def restore(self, checkpoint: Checkpoint) -> None:
        self.backend.restore(self.state, checkpoint.snapshot)
        self.tokens = list(checkpoint.tokens)
        self.last_hidden = checkpoint.last_hidden.clone() if checkpoint.last_hidden is not None else None
        self._backlog_tokens, self._backlog_hidden = [], []

    def reset(self) -> None:
        """Back to empty (a fresh state; the old one's memory is released)."""
        self.state = self.backend.new_state(self.max_len)
        self.tokens = []
        self.last_hidden = None
        self._backlog_tokens, self._backlog_hidden = [], []

"""One sequence driven by a back end: its state, the tokens it has consumed, and the MTP head kept in step.

The MTP head at position p consumes the pair (token t[p+1], main hidden H[p]). The pairs completed by running
tokens through the main model are queued (the backlog) and run together with the next first draft step, so
the MTP cache holds every consumed position without an extra MTP call per cycle.

Invariant (when MTP is tracked and the sequence is not empty):
    state.mtp_length + len(backlog) == len(tokens) - 1, and `last_hidden` is H[len(tokens) - 1].
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from .backend import Backend, HostCopy, StepOutput, upload_ids

# Tokens per forward call when running a prompt or an MTP backlog: bounds the T x T attention scores and
# the other per-chunk activations (prefill and draft calls return the last row's logits only).
MAX_TOKENS_PER_CALL = 512


@dataclass
class Checkpoint:
    """A restorable point of a sequence: its first `len(tokens)` tokens and the state after them.

    The back end's snapshot may leave out the KV caches (the reference back end's does), so a checkpoint is
    restored only while the sequence still holds its tokens as a prefix (`Sequence.can_restore`). A `full`
    one holds them too and restores into any sequence of the same back end: a prefix shared across sessions.
    `mtp` says whether its MTP cache covers every position (the sequence tracked MTP)."""

    tokens: tuple[int, ...]
    snapshot: Any
    last_hidden: torch.Tensor | None
    nbytes: int
    full: bool = False
    mtp: bool = False


class Sequence:
    """The state of one sequence and the operations the engine loop needs on it."""

    def __init__(
        self, backend: Backend, max_len: int, *, track_mtp: bool, on_step: Callable[[], None] | None = None
    ) -> None:
        self.backend = backend
        # Called after every call into the model: the engine's progress, which the card's liveness reads.
        self.on_step = on_step or _nothing
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

    def stop_tracking_mtp(self) -> None:
        """Stop queueing MTP pairs (speculative decoding was turned off): the MTP cache is not kept complete
        from here on, so this sequence will not draft again."""
        self.track_mtp = False
        self._backlog_tokens, self._backlog_hidden = [], []

    def release_rollback_records(self) -> None:
        """Drop what the last verify kept for rollback (before the sequence is parked in a cache)."""
        self.backend.release(self.state)

    def ids(self, tokens: Seq[int]) -> torch.Tensor:
        """Host token ids as a tensor on the back end's device (`upload_ids`: non-blocking on a GPU)."""
        return upload_ids(tokens, self.backend.device)

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
    def _tokens_per_call(self) -> int:
        """The back end's prompt piece (a fast prefill path takes long ones), else MAX_TOKENS_PER_CALL."""
        return int(getattr(self.backend, "prefill_tokens", MAX_TOKENS_PER_CALL))

    def feed(self, tokens: Seq[int], *, ids: torch.Tensor | None = None) -> StepOutput:
        """Run `tokens` (a prompt or one decoded token) through the main model, in chunks; returns the
        last chunk's output. `ids`: the same tokens already on the device (saves an upload)."""
        out = None
        # One upload: a copy per chunk would wait for the previous chunk to finish.
        all_ids = self.ids(tokens) if ids is None else ids
        step = self._tokens_per_call()
        for start in range(0, len(tokens), step):
            piece = tokens[start : start + step]
            piece_ids = all_ids[start : start + step]
            if len(piece) > 1:
                out = self.backend.prefill(piece_ids, self.state)
            else:
                out = self.backend.decode(piece_ids, self.state)
            self._owe_mtp(piece, out.hidden)
            self.tokens.extend(piece)
            # A copy, so that a parked sequence does not keep a whole prompt chunk's hiddens alive.
            self.last_hidden = out.hidden[-1].clone() if len(piece) > 1 else out.hidden[-1]
            self.on_step()
        assert out is not None
        return out

    def decode_run(
        self,
        pending: int,
        pending_ids: torch.Tensor | None,
        limit: int,
        choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Iterator[int]:
        """Plain decoding of up to `limit` tokens after `pending` (emitted, not yet run), yielding each token as
        the host reads it back. One step runs ahead: step N + 1 is queued, fed by token N on the device, before
        the host reads token N, so the device never waits for the host in between.

        `choose` picks each next token on the device from a step's logits ([1, V] -> [1], queued behind the
        step without synchronising: a sampler with its penalties, temperature and truncation); None takes
        the back end's own argmax (plain greedy).

        When the caller stops taking tokens (a stop, a cancellation: it closes the generator), the step queued
        ahead has already consumed the last token yielded; it completes and stays, so the state has run every
        emitted token (a valid state: a later turn continues after it). Only for a sequence that does not
        track MTP pairs (plain decoding owes none)."""
        if self.track_mtp:
            raise RuntimeError("decode_run is plain decoding: this sequence tracks MTP pairs")
        if limit < 1:
            return
        backend = self.backend
        ahead = getattr(backend, "decode_ahead", None)
        if ahead is None:  # a back end without the queued step: one synchronising step at a time
            yield from self._decode_synced(pending, pending_ids, limit, choose)
            return

        def queue(ids: torch.Tensor | None) -> tuple[Any, torch.Tensor | None, HostCopy | None]:
            """One step queued, and the token after it chosen behind it (None: the step's argmax feeds on)."""
            step = ahead(ids, self.state)
            if choose is None:
                return step, None, None
            chosen = choose(step.logits).reshape(-1)
            return step, chosen, HostCopy(chosen)

        ids = self.ids([pending]) if pending_ids is None else pending_ids.reshape(-1)
        (step, chosen, copy), last = queue(ids), None
        self.tokens.append(pending)
        produced = 0
        try:
            while step is not None:
                produced += 1
                # Queued before reading this step's token: it takes that token from the device.
                following = queue(chosen) if produced < limit else (None, None, None)
                token = backend.ahead_token(step)  # waits for the step (and raises what it raised)
                if copy is not None:
                    token = copy.value()
                self.on_step()
                last, (step, chosen, copy) = step, following
                if step is not None:
                    self.tokens.append(token)
                yield token
        except GeneratorExit:
            if step is not None:  # run ahead of a caller that stopped: it consumed the last token yielded
                backend.ahead_token(step)  # waits for it (and raises what it raised)
                self.on_step()
                last = step
            raise
        finally:
            if last is not None:
                # The hidden of the last step run (H[len(tokens) - 1]), copied before anything overwrites it.
                self.last_hidden = last.hidden[-1].clone()

    def _decode_synced(
        self,
        pending: int,
        pending_ids: torch.Tensor | None,
        limit: int,
        choose: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> Iterator[int]:
        for _ in range(limit):
            out = self.feed([pending], ids=pending_ids)
            logits = out.logits[-1:]
            pending_ids = logits.argmax(dim=-1) if choose is None else choose(logits).reshape(-1)
            pending = int(pending_ids.item())
            yield pending

    def run_verify(self, inputs: torch.Tensor) -> StepOutput:
        """Run [pending, d1..dk] (on the device) keeping every position reachable; `accept_verified` then
        commits."""
        out = self.backend.decode(inputs, self.state, keep_states=True)
        self.on_step()
        return out

    def run_verify_greedy(self, inputs: torch.Tensor) -> tuple[StepOutput, int, list[int], list[int]]:
        """`run_verify` with greedy acceptance decided by the back end (on the device where it can):
        (output, accepted drafts, argmax per position, the inputs on the host)."""
        result = self.backend.verify_greedy(inputs, self.state)
        self.on_step()
        return result

    def accept_verified(self, inputs: Seq[int], verify: StepOutput, kept: int) -> None:
        """Keep the first `kept` verified inputs in the state (roll back the rest).

        `draft_first` already gave the MTP cache the pair of inputs[0]; the kept drafts' pairs are owed (when
        MTP is tracked: drafts copied from the context verify on a sequence that may not track it)."""
        self.backend.rollback(self.state, len(inputs) - kept)
        if kept > 1 and self.track_mtp:
            self._backlog_tokens.extend(inputs[1:kept])
            self._backlog_hidden.append(verify.hidden[: kept - 1])
        self.tokens.extend(inputs[:kept])
        self.last_hidden = verify.hidden[kept - 1]

    # ---- MTP drafting -------------------------------------------------------------------------------
    def draft_first(self, pending: int) -> StepOutput:
        """First draft step after `pending` (the emitted token not yet run): runs the owed MTP pairs and
        (pending, H[last]) together; the last row's logits draft the token after `pending`."""
        return self._run_mtp(*self._first_pairs(pending))

    def draft_greedy(self, pending: int, k: int) -> torch.Tensor:
        """`k` greedy (plain argmax) drafts after `pending`, the first step as `draft_first`'s, the rest fed
        on the device (the back end's `draft_greedy`: no host work between the steps). [k] on the device; the
        MTP positions of the drafts after the first are left for `drop_draft_positions(k - 1)`."""
        tokens, hidden = self._first_pairs(pending)
        step = self._tokens_per_call()
        last = (
            (len(tokens) - 1) // step * step
        )  # the pairs before the last call's, run as `_run_mtp` cuts them
        if last:
            self._run_mtp(tokens[:last], hidden[:last])
        # Host ids: the back end uploads them as it needs (the megakernel with its launch's control block).
        drafts = self.backend.draft_greedy(tokens[last:], hidden[last:], self.state, k)
        self.on_step()
        return drafts

    def _first_pairs(self, pending: int) -> tuple[list[int], torch.Tensor]:
        """The owed MTP pairs and (pending, H[last]), taken off the backlog."""
        assert self.track_mtp and self.last_hidden is not None
        tokens = [*self._backlog_tokens, pending]
        hidden = join_rows([*self._backlog_hidden, self.last_hidden.unsqueeze(0)])
        self._backlog_tokens, self._backlog_hidden = [], []
        return tokens, hidden

    def draft_next(self, token: torch.Tensor, mtp_hidden: torch.Tensor) -> StepOutput:
        """A further draft step: the previous draft (`[1]`, left on the device) with the MTP layer's own
        output."""
        return self.backend.draft(token, mtp_hidden, self.state)

    def draft_next_greedy(self, token: torch.Tensor, mtp_hidden: torch.Tensor, k: int) -> torch.Tensor:
        """`k` further greedy drafts after `token` (a draft left on the device) as one chain on the back end."""
        drafts = self.backend.draft_greedy(token, mtp_hidden, self.state, k)
        self.on_step()
        return drafts

    def drop_draft_positions(self, n: int) -> None:
        """Forget the MTP positions written by draft steps after the first (their hiddens were drafts')."""
        self.backend.rollback_draft(self.state, n)

    def flush_mtp(self, limit: int | None = None) -> None:
        """Run the owed MTP pairs now (all, or the first `limit`): before a snapshot, so that the snapshot's
        MTP cache is complete, and before a restore that needs those MTP positions."""
        n = len(self._backlog_tokens) if limit is None else min(limit, len(self._backlog_tokens))
        if n <= 0:
            return
        hidden = torch.cat(self._backlog_hidden)
        self._run_mtp(self._backlog_tokens[:n], hidden[:n])
        self._backlog_tokens = self._backlog_tokens[n:]
        self._backlog_hidden = [hidden[n:]] if self._backlog_tokens else []

    def _run_mtp(self, tokens: Seq[int], hidden: torch.Tensor) -> StepOutput:
        """MTP pairs in chunks (a whole prompt's backlog would make T x T attention scores)."""
        out = None
        ids = self.ids(tokens)
        step = self._tokens_per_call()
        for start in range(0, len(tokens), step):
            end = start + step
            out = self.backend.draft(ids[start:end], hidden[start:end], self.state)
            self.on_step()
        assert out is not None
        return out

    # ---- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self, *, full: bool = False) -> Checkpoint:
        self.flush_mtp()
        snapshot = self.backend.snapshot(self.state, full=full)
        last = self.last_hidden.clone() if self.last_hidden is not None else None
        hidden_bytes = last.numel() * last.element_size() if last is not None else 0
        nbytes = self.backend.nbytes(snapshot) + hidden_bytes
        return Checkpoint(tuple(self.tokens), snapshot, last, nbytes, full=full, mtp=self.track_mtp)

    def can_restore(self, checkpoint: Checkpoint) -> bool:
        """Whether the checkpoint can be restored here: a full one whenever its MTP cache is as complete as
        this sequence needs; a light one while the sequence still holds its tokens (its KV caches)."""
        if checkpoint.full:
            return checkpoint.mtp or not self.track_mtp
        n = len(checkpoint.tokens)
        return n <= len(self.tokens) and tuple(self.tokens[:n]) == checkpoint.tokens

    def restore(self, checkpoint: Checkpoint) -> None:
        """Return to `checkpoint`, which `can_restore` must allow."""
        if self.track_mtp and not checkpoint.full and len(checkpoint.tokens) > 1:
            # The checkpoint's MTP cache covers its len - 1 pairs; ours may still owe some of them.
            in_cache = len(self.tokens) - 1 - len(self._backlog_tokens)
            self.flush_mtp(len(checkpoint.tokens) - 1 - in_cache)
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


def join_rows(pieces: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(pieces)` of [n, H] row blocks, but a view when they are consecutive rows of one tensor: after a
    verify, the accepted drafts' hiddens and the last kept one are its output's first rows, and a copy there would
    sit on the speculative cycle's critical path (between the verify's read-back and the next draft)."""
    first = pieces[0]
    if len(pieces) == 1:
        return first
    if first.dim() == 2 and all(_rows_follow(a, b) for a, b in pairwise(pieces)):
        rows = sum(piece.shape[0] for piece in pieces)
        return first.as_strided((rows, first.shape[1]), first.stride())
    return torch.cat(pieces)


def _rows_follow(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b's rows start where a's end, as views of one storage with one layout. (The storage, not the
    views' `_base`: views of inference tensors, which the megakernel back end returns, record no base.)"""
    return (
        b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        and b.dtype == a.dtype
        and b.dim() == 2
        and b.stride() == a.stride()
        and b.shape[1] == a.shape[1]
        and b.storage_offset() == a.storage_offset() + a.shape[0] * a.stride(0)
    )


def _nothing() -> None:
    pass

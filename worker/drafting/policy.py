"""Which drafter drafts each cycle, and how many tokens: the lookup's copy, the MTP head, or no draft.

Modes: `mtp` (the head alone), `lookup` (copies from the context alone; a cycle without a match runs a plain
step), `combined` (a lookup match is drafted unless the MTP head is more confident of another next token).
The comparison costs one small read-back per cycle that has a match: the head's top token and its
probability, against the lookup's recent first-position acceptance. Both are functions of the context
only (not of a sampled draft), so the chosen draft's distribution is still the q rejection sampling uses.

In `combined`, an MTP draft is continued by a copy (`extend_mtp`): when the context followed by the head's
drafts ends in an n-gram seen before, what followed it is appended, up to the lookup's length. The head
often drafts the token that brings a loop or a quoted stretch back to where the lookup finds it. The copied
tokens are a function of the context and the drafts before them, so their q is the one-hot on each.

Draft lengths adapt per source (`AdaptiveLength`): a cycle whose drafts were all accepted drafts more next
time, one that failed drafts fewer, within [1, the source's maximum].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..sampling import RequestSampler
from ..sequence import Sequence
from .base import LOOKUP, MTP, Draft
from .lookup import NGramIndex
from .mtp import continue_mtp_draft, mtp_draft

MODES = ("combined", "mtp", "lookup")
DEFAULT_MODE = "combined"
# n-gram lengths the lookup matches, longest first (chosen by `onestream eval spec --workload`, benchmarks.md).
DEFAULT_NGRAM = (2, 4)
# The lookup's most drafts per cycle when the back end sets no bound of its own (verify cost grows with
# the drafts; a copied run is rarely accepted further in one go).
DEFAULT_LOOKUP_K = 8
# Prior of the lookup's first-position acceptance, and the weight of each new cycle in its running mean.
LOOKUP_PRIOR = 0.5
LOOKUP_DECAY = 0.1


class Drafter(Protocol):
    source: str

    def propose(self, seq: Sequence, pending: int, sampler: RequestSampler, k: int) -> Draft | None:
        """Up to `k` drafts after `pending` (emitted, not yet run), or None when this drafter has none."""
        ...


class MTPDrafter:
    source = MTP

    def propose(self, seq: Sequence, pending: int, sampler: RequestSampler, k: int) -> Draft | None:
        return mtp_draft(seq, pending, sampler, k)


class LookupDrafter:
    """Drafts from an `NGramIndex` that holds the session's tokens up to and including `pending`.

    A copy continues: while the tokens emitted since the last draft are what followed that draft's source,
    the next draft is the source's continuation, without a lookup (the latest occurrence of a short n-gram
    is often another stretch than the one being copied)."""

    source = LOOKUP

    def __init__(self, index: NGramIndex) -> None:
        self.index = index
        self._copy: tuple[int, int] | None = None  # (where the last draft was copied from, tokens held then)

    def propose(self, seq: Sequence, pending: int, sampler: RequestSampler, k: int) -> Draft | None:
        if not self.index.tokens or self.index.tokens[-1] != pending:
            raise RuntimeError("the lookup index must hold every emitted token, the pending one included")
        if k < 1:
            return None
        start = self._continued()
        if start is None:
            found = self.index.match()
            if found is None:
                self._copy = None
                return None
            start = found[0]
        tokens = self.index.tokens[start : start + k]
        self._copy = (start, len(self.index.tokens))
        return Draft(seq.ids(tokens), LOOKUP, host_tokens=tokens)

    def _continued(self) -> int | None:
        """Where the copy in progress continues, if every token emitted since its last draft followed it."""
        if self._copy is None:
            return None
        start, held = self._copy
        own = self.index.tokens
        emitted = len(own) - held
        end = start + emitted
        if emitted < 1 or end >= len(own) or own[start:end] != own[held:]:
            return None
        return end


class AdaptiveLength:
    """A draft length in [1, maximum] that grows by 2 after a fully accepted cycle and shrinks by 1 after a
    failed one (assisted generation's schedule, Hugging Face transformers)."""

    def __init__(self, maximum: int) -> None:
        if maximum < 1:
            raise ValueError(f"a draft length needs a maximum of at least 1, got {maximum}")
        self.maximum = maximum
        self.k = maximum

    def update(self, drafted: int, accepted: int) -> None:
        if accepted >= drafted:
            self.k = min(self.maximum, self.k + 2)
        else:
            self.k = max(1, self.k - 1)


@dataclass
class DraftSettings:
    """How a request's cycles draft: the mode, the most drafts per source, the lookup's n-gram lengths,
    whether the lookup's draft lengths adapt (MTP drafts always take `mtp_k`) and whether `combined`
    continues an MTP draft with a copy (`extend_mtp`, up to the lookup's length)."""

    mode: str = DEFAULT_MODE
    mtp_k: int = 2
    lookup_k: int = DEFAULT_LOOKUP_K
    ngram: tuple[int, int] = DEFAULT_NGRAM
    adaptive: bool = True
    extend_mtp: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"drafting mode must be one of {MODES}, got {self.mode!r}")
        if self.mtp_k < 0 or self.lookup_k < 0:
            raise ValueError(f"draft lengths must be >= 0, got mtp_k={self.mtp_k}, lookup_k={self.lookup_k}")
        n_min, n_max = self.ngram
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths need 1 <= min <= max, got {self.ngram}")

    @property
    def uses_mtp(self) -> bool:
        return self.mode != LOOKUP and self.mtp_k > 0

    @property
    def uses_lookup(self) -> bool:
        return self.mode != MTP and self.lookup_k > 0

    @property
    def max_drafts(self) -> int:
        """The most drafts a cycle verifies (a verify runs this + 1 tokens)."""
        return max(self.mtp_k if self.uses_mtp else 0, self.lookup_k if self.uses_lookup else 0)


class DraftPolicy:
    """Chooses each cycle's draft (see the module's docstring) and learns from what was accepted."""

    def __init__(self, settings: DraftSettings, index: NGramIndex | None = None) -> None:
        if settings.uses_lookup and index is None:
            raise ValueError(f"drafting mode {settings.mode!r} needs an n-gram index of the session")
        self.settings = settings
        self.mtp = MTPDrafter() if settings.uses_mtp else None
        self.lookup = LookupDrafter(index) if settings.uses_lookup and index is not None else None
        self.lengths = {
            MTP: AdaptiveLength(max(settings.mtp_k, 1)),
            LOOKUP: AdaptiveLength(max(settings.lookup_k, 1)),
        }
        self.lookup_confidence = LOOKUP_PRIOR

    def length(self, source: str, limit: int) -> int:
        cap = self.settings.mtp_k if source == MTP else self.settings.lookup_k
        # MTP drafts keep their fixed k: on the H200 megakernel an adaptive MTP length cost 15 % of the tok/s
        # at k = 3 (docs/benchmarks.md); a copied draft's length is what varies from cycle to cycle.
        adapts = self.settings.adaptive and source == LOOKUP
        k = self.lengths[source].k if adapts else cap
        return max(0, min(k, cap, limit))

    def propose(self, seq: Sequence, pending: int, sampler: RequestSampler, limit: int) -> Draft | None:
        """The draft of the next cycle (at most `limit` tokens), or None for a plain step."""
        found = None
        if self.lookup is not None:
            found = self.lookup.propose(seq, pending, sampler, self.length(LOOKUP, limit))
        if self.mtp is None or self.length(MTP, limit) == 0:
            return found
        if found is None:
            return self._extended(
                seq, self.mtp.propose(seq, pending, sampler, self.length(MTP, limit)), limit
            )
        first = seq.draft_first(pending)  # keeps the MTP cache in step whichever draft is chosen
        probs = torch.softmax(first.logits[-1].float(), dim=-1)
        top_p, top = probs.max(dim=-1)
        top_token, confidence = torch.stack([top.to(top_p.dtype), top_p]).tolist()
        assert found.host_tokens is not None
        if int(top_token) == found.host_tokens[0] or confidence <= self.lookup_confidence:
            return found
        return self._extended(seq, continue_mtp_draft(seq, first, sampler, self.length(MTP, limit)), limit)

    def _extended(self, seq: Sequence, draft: Draft, limit: int) -> Draft:
        """`draft` (the MTP head's) continued by what followed the context's n-gram ending in it, up to the
        lookup's length; unchanged when it already fills that or the context holds no such n-gram. Reads
        the drafts back to the host (the cycle's one synchronisation moves before the verify)."""
        if not self.settings.extend_mtp or self.lookup is None:
            return draft
        room = self.length(LOOKUP, limit) - draft.k
        if room <= 0:
            return draft
        drafted = draft.tokens.tolist()
        copy, _ = self.lookup.index.continuation(room, after=drafted)
        if not copy:
            return Draft(draft.tokens, draft.source, draft.probs, host_tokens=drafted)
        copied = seq.ids(copy)
        probs = draft.probs
        if probs is not None:
            one_hot = torch.nn.functional.one_hot(copied, probs.shape[-1]).to(probs.dtype)
            probs = torch.cat([probs, one_hot])
        return Draft(torch.cat([draft.tokens, copied]), draft.source, probs, host_tokens=drafted + copy)

    def record(self, draft: Draft, accepted: int) -> None:
        self.lengths[draft.source].update(draft.k, accepted)
        if draft.source == LOOKUP:
            hit = 1.0 if accepted > 0 else 0.0
            self.lookup_confidence += LOOKUP_DECAY * (hit - self.lookup_confidence)

"""The greedy drafts' vocabulary: the MTP head's argmax among the first token ids only.

A draft step's cost is mostly the lm_head it reads (the 27B's 248,320 rows against one MTP layer), while the
drafts only have to be right often, not always: the verify scores every token. BPE token ids are in merge order,
so the first ids tend to be the most frequent pieces; the prefix is chosen from the tokens the card generates
(DraftVocabulary), so a tokenizer whose order says little costs a longer prefix, not acceptance (the idea of
FR-Spec, Zhao et al. 2025, kept to a prefix so that the kernel reads the lm_head's first rows and needs no copy
of them). Greedy output is unchanged: the verify decides every token.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import InvalidRequestError

ALIGN = 8  # lm_head rows come in multiples of this (the megakernel's GEMV items; kernels/layout.py passes it)
GRAIN = 1024  # chosen prefixes are whole multiples of this many ids (few distinct launches' row counts)
COVERAGE = 0.995  # the share of generated tokens the chosen prefix holds
WARMUP = 2048  # generated tokens seen before the first choice (until then: the whole vocabulary)
EVERY = 2048  # generated tokens between choices (each costs about 0.5 ms for a 248K vocabulary)
GAIN = 0.75  # a prefix of more than this share of the vocabulary saves too little: the whole one instead


class DraftVocabulary:
    """The prefix of token ids greedy drafts choose among, learnt from the tokens a card generates: the
    shortest that holds COVERAGE of them (rounded up to GRAIN ids), so that a draft misses the model's choice
    for want of an id at about 1 - COVERAGE of positions at most, whatever order the tokenizer gave its ids
    (a fixed eighth of the embedded model's vocabulary lost a quarter of its accepted length:
    docs/benchmarks.md)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.seen = 0  # generated tokens observed
        self._pending: list[int] = []  # counted at the next choice: a cycle only appends (its hot path)
        self.rows: int | None = None  # the current choice (None: the whole vocabulary)

    def observe(self, token_ids: list[int]) -> int | None:
        """Count generated tokens; returns the choice, updated every EVERY tokens once WARMUP are seen."""
        self._pending.extend(token_ids)
        self.seen += len(token_ids)
        if len(self._pending) >= EVERY and self.seen >= WARMUP:
            self.counts += np.bincount(self._pending, minlength=self.vocab_size)
            self._pending.clear()
            needed = int(np.searchsorted(np.cumsum(self.counts), COVERAGE * self.seen)) + 1
            rows = -(-needed // GRAIN) * GRAIN
            self.rows = rows if rows <= GAIN * self.vocab_size else None
        return self.rows


def check_draft_vocab(vocab: int | None, vocab_size: int) -> int:
    """The lm_head rows a greedy draft scores (0: all of them), or InvalidRequestError naming what is wrong."""
    if vocab is None or vocab == vocab_size:
        return 0
    if not 0 < vocab < vocab_size or vocab % ALIGN:
        raise InvalidRequestError(
            f"the draft vocabulary must be a multiple of {ALIGN} between {ALIGN} and the vocabulary's "
            f"{vocab_size} tokens, got {vocab}"
        )
    return vocab


def greedy_draft(logits: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """The argmax of each row of `logits` among token ids below `vocab` (None: all)."""
    return (logits if vocab is None else logits[..., :vocab]).argmax(dim=-1)

"""The greedy drafts' vocabulary: the MTP head's argmax among the first token ids only.

A draft step's cost is mostly the lm_head it reads (the 27B's 248,320 rows against one MTP layer), while the
drafts only have to be right often, not always: the verify scores every token. BPE token ids are in merge order,
so the first ids are the most frequent pieces, and a draft chosen among them loses little acceptance
(the idea of FR-Spec, Zhao et al. 2025, with the id order standing in for a frequency table). Greedy output is
unchanged: the verify decides every token.
"""

from __future__ import annotations

import torch

from .errors import InvalidRequestError

ALIGN = 8  # the megakernel's GEMV takes rows in items of up to 8
LARGE_VOCAB = 65536  # vocabularies above this draft among their first DEFAULT_ROWS ids
DEFAULT_ROWS = 32768


def default_draft_vocab(vocab_size: int) -> int | None:
    """The draft vocabulary a model of `vocab_size` tokens ships with: None (the whole vocabulary) up to
    LARGE_VOCAB, else the first DEFAULT_ROWS ids."""
    return DEFAULT_ROWS if vocab_size > LARGE_VOCAB else None


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

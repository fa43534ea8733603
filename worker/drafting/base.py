"""What a drafter proposes for one speculative cycle, and the sources drafts come from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MTP = "mtp"
LOOKUP = "lookup"
SOURCES = (MTP, LOOKUP)


@dataclass
class Draft:
    """k draft tokens after the pending token, with what the verify needs to accept them.

    `probs` [k, V] is the distribution each token was drawn from, when sampling; None for a deterministic
    draft (a copy from the context, or any greedy draft), whose distribution is the one-hot on its token
    (`draft_distributions`). Rejection sampling stays exact with either: it needs the true q of each draft.
    """

    tokens: torch.Tensor  # [k] LongTensor on the back end's device
    source: str
    probs: torch.Tensor | None = None
    host_tokens: list[int] | None = None  # the tokens on the host, where the drafter had them there

    @property
    def k(self) -> int:
        return int(self.tokens.shape[0])


def draft_distributions(draft: Draft, vocab_size: int) -> torch.Tensor:
    """q [k, V] for rejection sampling: the draft's own distributions, or one-hots for a deterministic one."""
    if draft.probs is not None:
        return draft.probs
    return torch.nn.functional.one_hot(draft.tokens, vocab_size).float()

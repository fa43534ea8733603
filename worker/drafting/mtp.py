"""Drafting with the model's MTP head: each step feeds the previous draft and the head's own hidden state."""

from __future__ import annotations

import torch

from ..backend import StepOutput
from ..draft_vocab import greedy_draft
from ..sampling import RequestSampler, sample
from ..sequence import Sequence
from .base import MTP, Draft


def mtp_draft(seq: Sequence, pending: int, sampler: RequestSampler, k: int) -> Draft:
    """k MTP drafts after `pending` (emitted, not yet run); the first step also runs the owed MTP pairs.
    Plain argmax drafts run as one chain on the back end (`Sequence.draft_greedy`): the logits never reach
    the host's code, so nothing is queued between the steps."""
    if sampler.plain_argmax:
        drafts = seq.draft_greedy(pending, k)
        seq.drop_draft_positions(k - 1)
        return Draft(drafts, MTP)
    return continue_mtp_draft(seq, seq.draft_first(pending), sampler, k)


def continue_mtp_draft(seq: Sequence, first: StepOutput, sampler: RequestSampler, k: int) -> Draft:
    """k MTP drafts, the first from `first` (the output of `Sequence.draft_first`). The drafts stay on the
    device; the MTP positions written by steps after the first are dropped (their hiddens were drafts')."""
    if sampler.plain_argmax:
        token = greedy_draft(first.logits[-1:], seq.backend.draft_vocab)
        if k > 1:
            token = torch.cat([token, seq.draft_next_greedy(token, first.hidden[-1:], k - 1)])
        seq.drop_draft_positions(k - 1)
        return Draft(token, MTP)
    drafts: list[torch.Tensor] = []  # [1] each
    draft_probs: list[torch.Tensor] = []
    out = first
    for step in range(k):
        if step:
            out = seq.draft_next(drafts[-1], out.hidden[-1:])
        logits = out.logits[-1:]
        before = torch.cat(drafts) if drafts and sampler.uses_history else ()
        if sampler.params.greedy:
            token = sampler.next_tokens(logits, before=before)
        else:
            probs = sampler.probabilities(logits, before=before)
            token = sample(probs, sampler.generator)
            draft_probs.append(probs)
        drafts.append(token)
    seq.drop_draft_positions(k - 1)
    return Draft(torch.cat(drafts), MTP, torch.cat(draft_probs) if draft_probs else None)

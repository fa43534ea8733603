"""Speculative decoding with the model's MTP head: draft k tokens, verify them in one pass, accept a prefix.

What is preserved exactly:
- Greedy (temperature 0): a draft is accepted only while it equals the target's argmax at that position, and
  the next token is the target's argmax after the accepted prefix, so the output is the sequence plain greedy
  decoding produces from the same target logits (token for token; it can differ from a one-token-per-step
  decode only where the verify pass's logits differ numerically from a single step's, at exact near-ties).
- Sampling: standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Each output
  token is distributed exactly as the request's *processed* target distribution p at that position: the same
  penalties (over the same history, accepted drafts included), temperature, min-p, top-k and top-p that plain
  sampling applies. The draft distribution q is processed the same way; any q keeps the output exact, a q
  closer to p only raises acceptance. The random stream differs from plain sampling, so a seeded speculative
  run reproduces itself, not a seeded plain run.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from .backend import StepOutput
from .sampling import RequestSampler, sample
from .sequence import Sequence


def accept_greedy(target_tokens: Seq[int], drafts: Seq[int]) -> tuple[int, int]:
    """(accepted drafts, next token) given the target's argmax at each of the k+1 verified positions."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, int(target_tokens[accepted])


def accept_sampled(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: Seq[int], generator: torch.Generator
) -> tuple[int, int]:
    """Speculative rejection sampling.

    target_probs [k+1, V]: p at each verified position (row j conditions on drafts[:j]);
    draft_probs [k, V]: the q each draft was sampled from. Draft x_j is accepted with probability
    min(1, p_j(x_j) / q_j(x_j)); at the first rejection the next token is drawn from norm(max(0, p_j - q_j));
    when all k are accepted a bonus token is drawn from p_k. Returns (accepted drafts, next token).
    """
    k = len(drafts)
    if k:
        index = torch.arange(k, device=target_probs.device)
        ids = torch.as_tensor(list(drafts), device=target_probs.device)
        p_draft = target_probs[index, ids]
        q_draft = draft_probs[index, ids]
        uniform = torch.rand(k, generator=generator, device=target_probs.device)
        # u < p/q, written without dividing (q > 0: each draft was sampled from q).
        rejected = (uniform * q_draft >= p_draft).tolist()
    else:
        rejected = []
    for j in range(k):
        if rejected[j]:
            residual = (target_probs[j] - draft_probs[j]).clamp_(min=0.0)
            total = residual.sum()
            # p == q up to rounding: rejection had probability ~0; p itself is the right fallback.
            residual = residual / total if total > 0 else target_probs[j]
            return j, int(sample(residual.unsqueeze(0), generator)[0])
    return k, int(sample(target_probs[k : k + 1], generator)[0])


@dataclass
class SpecStats:
    """Counters of one generation (vLLM's spec-decode metrics)."""

    drafts: int = 0  # verify cycles
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, k: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += k
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < k:
            self.accepted_per_position.extend([0] * (k - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify cycle (accepted drafts + the one token every cycle yields)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


@dataclass
class Cycle:
    """One draft-and-verify cycle, verified but not yet committed to the sequence."""

    inputs: list[int]  # [pending token, d1..dk], all run through the verify pass
    verify: StepOutput  # the verify pass's output
    tokens: list[int]  # accepted drafts + the next token: what this cycle yields


class SpeculativeDecoder:
    """Runs MTP-draft / verify cycles on a `Sequence` that keeps its MTP cache in step."""

    def __init__(self, k: int, stats: SpecStats) -> None:
        if k < 1:
            raise ValueError(f"speculative decoding needs k >= 1 drafts, got {k}")
        self.k = k
        self.stats = stats

    def propose(self, seq: Sequence, pending: int, sampler: RequestSampler, k: int) -> Cycle:
        """Draft `k` tokens after `pending` (emitted, not yet run), verify them, choose what to accept.

        The sequence is left with every verified input run; `commit` rolls back the rejected suffix.
        """
        drafts, draft_probs = self._draft(seq, pending, sampler, k)
        inputs = [pending, *drafts]
        verify = seq.run_verify(inputs)
        if sampler.params.greedy:
            targets = sampler.next_tokens(verify.logits, per_row=drafts).tolist()
            accepted, next_token = accept_greedy(targets, drafts)
        else:
            target_probs = sampler.probabilities(verify.logits, per_row=drafts)
            accepted, next_token = accept_sampled(
                target_probs, torch.cat(draft_probs), drafts, sampler.generator
            )
        self.stats.record(k, accepted)
        return Cycle(inputs, verify, [*drafts[:accepted], next_token])

    def commit(self, seq: Sequence, cycle: Cycle, kept: int) -> None:
        """Keep the first `kept` tokens the cycle yielded: the pending token and the drafts before the last
        kept token stay in the state; everything after is rolled back (main model and MTP cache)."""
        seq.accept_verified(cycle.inputs, cycle.verify, kept)

    def _draft(
        self, seq: Sequence, pending: int, sampler: RequestSampler, k: int
    ) -> tuple[list[int], list[torch.Tensor]]:
        drafts: list[int] = []
        draft_probs: list[torch.Tensor] = []
        out = seq.draft_first(pending)
        for step in range(k):
            if step:
                out = seq.draft_next(drafts[-1], out.hidden[-1:])
            logits = out.logits[-1:]
            if sampler.params.greedy:
                token = int(sampler.next_tokens(logits, before=drafts)[0])
            else:
                probs = sampler.probabilities(logits, before=drafts)
                token = int(sample(probs, sampler.generator)[0])
                draft_probs.append(probs)
            drafts.append(token)
        seq.drop_draft_positions(k - 1)
        return drafts, draft_probs

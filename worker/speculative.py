"""Speculative decoding: draft k tokens (the MTP head or a copy from the context, worker/drafting/), verify
them in one pass, accept a prefix.

What is preserved exactly:
- Greedy (temperature 0): a draft is accepted only while it equals the target's argmax at that position, and
  the next token is the target's argmax after the accepted prefix, so the output is the sequence plain greedy
  decoding produces from the same target logits (token for token; it can differ from a one-token-per-step
  decode only where the verify pass's logits differ numerically from a single step's, at exact near-ties).
- Sampling: standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Each output
  token is distributed exactly as the request's *processed* target distribution p at that position: the same
  penalties (over the same history, accepted drafts included), temperature, min-p, top-k and top-p that plain
  sampling applies. The MTP draft distribution q is processed the same way; a draft copied from the context
  is deterministic, its q the one-hot on its token. Any q keeps the output exact, a q closer to p only raises
  acceptance. The random stream differs from plain sampling, so a seeded speculative
  run reproduces itself, not a seeded plain run.

On an accelerator a cycle synchronises with the host once: drafts stay on the device from one draft step to
the next and into the verify pass, and the acceptance is settled there; the host reads back the drafts, the
number accepted and the next token (the megakernel's plain-greedy cycles: its control block).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from .backend import StepOutput
from .drafting import MTP, SOURCES, Draft, DraftPolicy, DraftSettings, draft_distributions
from .sampling import RequestSampler, sample
from .sequence import Sequence


def sampled_decisions(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Speculative rejection sampling, computed on the device without synchronising.

    target_probs [k+1, V]: p at each verified position (row j conditions on drafts[:j]);
    draft_probs [k, V]: the q each draft was sampled from; drafts [k] (LongTensor). Draft x_j is accepted
    with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the next token is drawn from
    norm(max(0, p_j - q_j)); when all k are accepted a bonus token is drawn from p_k. Every position's
    residual token is drawn up front (independently of the acceptance tests, so the first rejected one is
    still an exact draw). Returns [2k+1]: rejected flags, residual tokens, bonus token (`resolve_sampled`).
    """
    k = drafts.shape[0]
    index = torch.arange(k, device=target_probs.device)
    p_draft = target_probs[index, drafts]
    q_draft = draft_probs[index, drafts]
    uniform = torch.rand(k, generator=generator, device=target_probs.device)
    # u < p/q, written without dividing (q > 0: each draft was sampled from q).
    rejected = uniform * q_draft >= p_draft
    residual = (target_probs[:k] - draft_probs).clamp_(min=0.0)
    total = residual.sum(dim=-1, keepdim=True)
    # p == q up to rounding: rejection had probability ~0; p itself is the right fallback.
    residual = torch.where(
        total > 0, residual / total.clamp_min(torch.finfo(total.dtype).tiny), target_probs[:k]
    )
    return torch.cat(
        [rejected.long(), sample(residual, generator), sample(target_probs[k : k + 1], generator)]
    )


def settle(rejected: torch.Tensor, replacements: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """[accepted drafts, next token] on the device: the drafts before the first rejected one are accepted; the
    next token is that position's replacement, or `bonus` when none is rejected. rejected, replacements [k]."""
    k = rejected.shape[0]
    positions = torch.arange(k, device=rejected.device)
    first = torch.where(rejected, positions, k).min()
    replacement = replacements[first.clamp(max=k - 1)]
    return torch.stack([first, torch.where(first < k, replacement, bonus.reshape(()))])


def resolve_sampled(decisions: Seq[int], k: int) -> tuple[int, int]:
    """(accepted drafts, next token) from `sampled_decisions`' values read back to the host."""
    for j in range(k):
        if decisions[j]:
            return j, int(decisions[k + j])
    return k, int(decisions[2 * k])


def accept_sampled(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: Seq[int] | torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Speculative rejection sampling (see `sampled_decisions`). Returns (accepted drafts, next token)."""
    ids = torch.as_tensor(drafts, dtype=torch.long, device=target_probs.device).reshape(-1)
    return resolve_sampled(sampled_decisions(target_probs, draft_probs, ids, generator).tolist(), len(ids))


@dataclass
class DraftCounts:
    """Counters of the cycles whose drafts came from one source (vLLM's spec-decode metrics)."""

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

    def add(self, other: DraftCounts) -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        if len(self.accepted_per_position) < len(other.accepted_per_position):
            self.accepted_per_position.extend(
                [0] * (len(other.accepted_per_position) - len(self.accepted_per_position))
            )
        for position, accepted in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify cycle (accepted drafts + the one token every cycle yields)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


class SpecStats(DraftCounts):
    """Counters of one generation, in all and by draft source."""

    def __init__(self) -> None:
        super().__init__()
        self.by_source: dict[str, DraftCounts] = {source: DraftCounts() for source in SOURCES}

    def record(self, k: int, accepted: int, source: str = MTP) -> None:
        super().record(k, accepted)
        self.by_source[source].record(k, accepted)


@dataclass
class Cycle:
    """One draft-and-verify cycle, verified but not yet committed to the sequence."""

    inputs: list[int]  # [pending token, d1..dk] (host copy), all run through the verify pass
    verify: StepOutput  # the verify pass's output
    tokens: list[int]  # accepted drafts + the next token: what this cycle yields
    source: str = MTP


class SpeculativeDecoder:
    """Runs draft / verify cycles on a `Sequence` (one that keeps its MTP cache in step when MTP drafts).

    `policy` chooses each cycle's draft; by default the MTP head's, `k` drafts every cycle."""

    def __init__(self, k: int, stats: SpecStats, policy: DraftPolicy | None = None) -> None:
        if k < 1:
            raise ValueError(f"speculative decoding needs k >= 1 drafts, got {k}")
        self.k = k
        self.stats = stats
        self.policy = policy or DraftPolicy(DraftSettings(mode=MTP, mtp_k=k, adaptive=False))

    def propose(self, seq: Sequence, pending: int, sampler: RequestSampler, k: int) -> Cycle | None:
        """Draft at most `k` tokens after `pending` (emitted, not yet run), verify them, choose what to accept;
        None when the policy has no draft for this cycle (the caller runs a plain step).

        The sequence is left with every verified input run; `commit` rolls back the rejected suffix.
        """
        draft = self.policy.propose(seq, pending, sampler, min(k, self.k))
        if draft is None:
            return None
        # Uploaded once the drafts are queued: the device is busy with them while the host does this.
        pending_ids = seq.ids([pending])
        drafts, k = draft.tokens, draft.k
        if sampler.plain_argmax:
            # Plain argmax: the back end verifies and accepts (the megakernel on the device, reading back only
            # its control block).
            verify, accepted, targets, inputs = seq.run_verify_greedy(torch.cat([pending_ids, drafts]))
            self._record(draft, accepted)
            return Cycle(inputs, verify, [*inputs[1 : accepted + 1], targets[accepted]], draft.source)
        verify = seq.run_verify(torch.cat([pending_ids, drafts]))
        if sampler.params.greedy:
            targets = sampler.next_tokens(verify.logits, per_row=drafts)
            settled = settle(drafts != targets[:k], targets[:k], targets[k])
        else:
            target_probs = sampler.probabilities(verify.logits, per_row=drafts)
            q = draft_distributions(draft, target_probs.shape[-1])
            decisions = sampled_decisions(target_probs, q, drafts, sampler.generator)
            settled = settle(decisions[:k].bool(), decisions[k : 2 * k], decisions[2 * k])
        host = torch.cat([drafts, settled]).tolist()  # the cycle's one synchronisation: drafts, count, next
        host_drafts, (accepted, next_token) = host[:k], host[k:]
        self._record(draft, accepted)
        return Cycle([pending, *host_drafts], verify, [*host_drafts[:accepted], next_token], draft.source)

    def _record(self, draft: Draft, accepted: int) -> None:
        self.stats.record(draft.k, accepted, draft.source)
        self.policy.record(draft, accepted)

    def commit(self, seq: Sequence, cycle: Cycle, kept: int) -> None:
        """Keep the first `kept` tokens the cycle yielded: the pending token and the drafts before the last
        kept token stay in the state; everything after is rolled back (main model and MTP cache)."""
        seq.accept_verified(cycle.inputs, cycle.verify, kept)

"""The logits -> next-token pipeline of one request (its parameters are `api.SamplingParams`).

Order of processing (vLLM's): logit bias -> penalties -> temperature -> min-p -> top-k -> top-p -> sample.
Greedy (temperature 0) takes the argmax of the penalised logits.

Penalties follow vLLM / Hugging Face:
- repetition penalty over prompt + generated tokens: a seen token's logit is divided by the penalty when
  positive and multiplied by it when negative;
- frequency penalty subtracts `penalty * count` and presence penalty subtracts `penalty` (once) for every
  token that has been *generated* so far (prompt tokens do not count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .api import SamplingParams

# Token ids given as host ints or as a LongTensor already on the device (drafts never leave the device).
TokenIds = Sequence[int] | torch.Tensor


class TokenHistory:
    """What the penalties look at: which tokens the prompt or output contains, and output counts.

    Kept on the logits' device as dense [V] tensors so that penalising costs a few vector ops, none of
    which synchronises with the host.
    """

    def __init__(self, prompt_ids: Sequence[int], vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.seen.index_fill_(0, self._ids([t for t in prompt_ids if 0 <= t < vocab_size]), True)
        self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)

    def _ids(self, token_ids: TokenIds) -> torch.Tensor:
        if isinstance(token_ids, torch.Tensor):
            return token_ids.reshape(-1).to(device=self.device, dtype=torch.long)
        return torch.tensor(list(token_ids), dtype=torch.long, device=self.device)

    def append(self, token_ids: TokenIds) -> None:
        """Record generated tokens. `index_fill_`, not `seen[ids] = True`: indexed assignment waits for the
        device on CUDA, and a decode run ahead of the host records every token before it is read."""
        ids = self._ids(token_ids)
        self.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.seen.index_fill_(0, ids, True)

    def rows(
        self, n_rows: int, before: TokenIds = (), per_row: TokenIds = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen [T, V], output counts [T, V]): every row also counts `before` as generated, and row j
        also counts `per_row[:j]` (the drafts ahead of a verified position)."""
        counts = self.output_counts.unsqueeze(0).repeat(n_rows, 1)
        before_ids = self._ids(before)
        if before_ids.numel():
            counts.index_add_(
                1, before_ids, torch.ones(n_rows, before_ids.numel(), dtype=torch.int32, device=self.device)
            )
        ahead = self._ids(per_row)[: n_rows - 1]
        if ahead.numel():
            one_hot = torch.zeros(ahead.numel(), self.vocab_size, dtype=torch.int32, device=self.device)
            one_hot.scatter_(1, ahead.unsqueeze(1), 1)
            counts[1 : ahead.numel() + 1] += one_hot.cumsum(0, dtype=torch.int32)
        # `seen` already holds every generated token; the extra counts add the drafts.
        return self.seen.unsqueeze(0) | (counts > 0), counts


class LogitBias(NamedTuple):
    """A request's logit bias on its device, uploaded once: adding it to a step's logits then queues behind the
    step without a host round trip (an upload or an index list per token would wait for the device)."""

    ids: torch.Tensor  # [n] token ids, distinct
    values: torch.Tensor  # [n] fp32 biases

    @classmethod
    def of(cls, params: SamplingParams, device: torch.device | str) -> LogitBias | None:
        if not params.logit_bias:
            return None
        table = dict(params.logit_bias)  # a repeated id keeps its last bias
        ids = torch.tensor(list(table), dtype=torch.long, device=device)
        return cls(ids, torch.tensor(list(table.values()), dtype=torch.float32, device=device))

    def added_to(self, logits: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of `logits` [T, V] with the bias added to every row."""
        out = logits.float().clone()
        return out.index_add_(1, self.ids, self.values.expand(out.shape[0], -1))


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    history: TokenHistory | None,
    before: TokenIds = (),
    per_row: TokenIds = (),
    bias: LogitBias | None = None,
) -> torch.Tensor:
    """Biased and penalised copy of `logits` [T, V] (see `TokenHistory.rows` for `before` and `per_row`).
    `bias`: `params.logit_bias` already on the device (`LogitBias.of`); made here when None."""
    if bias is None:
        bias = LogitBias.of(params, logits.device)
    if bias is not None:
        logits = bias.added_to(logits)
    if history is None or not params.has_penalties:
        return logits
    seen, counts = history.rows(logits.shape[0], before, per_row)
    logits = logits.float().clone()
    if params.repetition_penalty != 1:
        penalised = torch.where(
            logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
        )
        logits = torch.where(seen, penalised, logits)
    if params.frequency_penalty != 0:
        logits -= params.frequency_penalty * counts.to(logits.dtype)
    if params.presence_penalty != 0:
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _truncate(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """min-p, then top-k, then top-p on probabilities [T, V]; renormalised; the top token always stays."""
    if params.min_p > 0:
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    top_k = params.top_k if params.top_k > 0 else 0
    if top_k and top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        total = sorted_probs.sum(dim=-1, keepdim=True)
        mass_before = (sorted_probs.cumsum(dim=-1) - sorted_probs) / total
        drop_sorted = mass_before >= params.top_p
        drop_sorted[:, 0] = False
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def probabilities(
    logits: torch.Tensor,
    params: SamplingParams,
    history: TokenHistory | None = None,
    before: TokenIds = (),
    per_row: TokenIds = (),
    bias: LogitBias | None = None,
) -> torch.Tensor:
    """The distribution a request samples from, per row of `logits` [T, V] (fp32 [T, V]).

    Greedy requests get a one-hot on the penalised argmax, so that one code path serves both.
    """
    logits = apply_penalties(logits.float(), params, history, before, per_row, bias)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.min_p > 0 or params.top_k > 0 or params.top_p < 1:
        probs = _truncate(probs, params)
    return probs


def greedy_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    history: TokenHistory | None = None,
    before: TokenIds = (),
    per_row: TokenIds = (),
    bias: LogitBias | None = None,
) -> torch.Tensor:
    """Argmax of the penalised logits, per row [T]."""
    return apply_penalties(logits.float(), params, history, before, per_row, bias).argmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [T, V], drawn exactly from that categorical distribution.

    The exponential race (argmax of p / E with E ~ Exp(1)) is equivalent to Gumbel-max and needs no
    host synchronisation or cumulative sums.
    """
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


class RequestSampler:
    """One request's sampling state: its parameters, its generator and its token history."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> None:
        self.params = params
        self.generator = _generator(params.seed, device)
        self.history = TokenHistory(prompt_ids, vocab_size, device) if params.has_penalties else None
        self.bias = LogitBias.of(params, device)

    def probabilities(
        self, logits: torch.Tensor, *, before: TokenIds = (), per_row: TokenIds = ()
    ) -> torch.Tensor:
        """The processed distribution of each row of `logits` [T, V]: every row counts `before` as
        generated, row j also `per_row[:j]`."""
        return probabilities(logits, self.params, self.history, before, per_row, self.bias)

    def next_tokens(
        self, logits: torch.Tensor, *, before: TokenIds = (), per_row: TokenIds = ()
    ) -> torch.Tensor:
        """Sample (or, greedy, take the argmax of) each row, with the history of `probabilities`."""
        if self.params.greedy:
            return greedy_tokens(logits, self.params, self.history, before, per_row, self.bias)
        return sample(self.probabilities(logits, before=before, per_row=per_row), self.generator)

    @property
    def uses_history(self) -> bool:
        """Whether the penalties look at the tokens before a row (`before`, `per_row`)."""
        return self.history is not None

    @property
    def plain_argmax(self) -> bool:
        """Greedy with nothing applied to the logits (no penalties, no bias): the token is the logits' plain
        argmax, which a back end can take on the device (the megakernel writes it with the logits)."""
        return self.params.greedy and self.history is None and not self.params.logit_bias

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of one row of logits ([1, V] -> [1] on the device), recorded as emitted: what a
        decode run ahead of the host queues behind each step (nothing here synchronises)."""
        token = self.next_tokens(logits)
        self.commit(token)
        return token

    def commit(self, token_ids: TokenIds) -> None:
        """Tokens that were emitted: from now on the penalties count them."""
        if self.history is not None:
            self.history.append(token_ids)


def _generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A per-request generator: seeded from `seed` (reproducible) or from the OS when None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator

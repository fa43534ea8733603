"""The megakernel back end: the engine's `Backend` protocol (worker/backend.py) on the decode megakernel.

On the kernel: decode and verify steps of 1..8 tokens (a verify records the DeltaNet states after each token
but the last, so that rolling back to any of them is a copy), greedy verification with the acceptance decided
on the device (`verify_greedy`: the host reads back the control block only), and MTP draft steps of 1..8
pairs. Short prompts run as the kernel's launches of up to 8 tokens, where the fast path's fixed cost (a few
thousand small launches, and the quantized weights read back to bf16) exceeds theirs. Longer prompts (by
default the fast path, worker/prefill/), longer steps and the state operations are the reference back end's
(the base class). All of them work on the same `SequenceState`, whose tensors the kernel reads and writes in
place, so switching between them costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from onestream.worker.backend import AheadStep, ReferenceBackend, upload_ids
from onestream.worker.kv_cache import DEFAULT_KV_FORMAT
from onestream.worker.model import StepOutput

from .layout import MAX_TOKENS_PER_LAUNCH
from .runtime import DEFAULT_TIMEOUT_S, MegakernelRunner
from .tuning import Tuning

# Prompts of at most this many tokens prefill as the kernel's launches: below it, launches of 8 tokens take less
# time than the fast prefill path on the 27B shapes (crossover 28-32 tokens: docs/benchmarks.md, session 20).
LAUNCH_PREFILL_TOKENS = 24


def launch_pieces(n: int, width: int = MAX_TOKENS_PER_LAUNCH) -> list[int]:
    """The launch sizes a prompt of `n` tokens runs as: full launches of `width`, then the remainder."""
    return [width] * (n // width) + ([n % width] if n % width else [])


class MegakernelBackend(ReferenceBackend):
    name = "megakernel"

    def __init__(
        self,
        model: Any,
        *,
        tuning: Tuning | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        prefill: str = "auto",
        launch_prefill_tokens: int = LAUNCH_PREFILL_TOKENS,
        kv_format: str = DEFAULT_KV_FORMAT,
    ) -> None:
        # auto: the fast prefill path (worker/prefill/)
        super().__init__(model, prefill=prefill, kv_format=kv_format)
        self.runner = MegakernelRunner(model, tuning=tuning, timeout_s=timeout_s, kv_cache=kv_format)
        self.launch_prefill_tokens = launch_prefill_tokens
        if (
            self.fast_prefill is not None
        ):  # the runner took the quantized weights: resize the prefill's scratch
            self.fast_prefill.weights_moved()

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, state: Any) -> StepOutput:
        """A short prompt as back-to-back launches (read back once, after the last), where every launch size it
        needs is built already: a compile would cost seconds on the request's path. Else the base class's."""
        n = input_ids.numel()
        pieces = launch_pieces(n)
        if n > self.launch_prefill_tokens or not all(self.runner.is_built(t) for t in pieces):
            return super().prefill(input_ids, state)
        ids, hidden, start = input_ids.reshape(-1), [], 0
        for i, t in enumerate(pieces):
            out = self.runner.step(ids[start : start + t], state, check=i == len(pieces) - 1)
            hidden.append(out.hidden.clone())  # every row: the sequence's MTP backlog pairs them
            start += t
        return StepOutput(out.logits[-1:].clone(), torch.cat(hidden))

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, state: Any, *, keep_states: bool = False) -> StepOutput:
        if input_ids.numel() > MAX_TOKENS_PER_LAUNCH:
            return super().decode(input_ids, state, keep_states=keep_states)
        out = self.runner.step(input_ids.reshape(-1), state, keep_states=keep_states)
        # Copies: the runner's buffers are overwritten by the next launch (a draft step, say).
        return StepOutput(out.logits.clone(), out.hidden.clone())

    @torch.inference_mode()
    def decode_ahead(self, input_ids: torch.Tensor | None, state: Any) -> AheadStep:
        """One greedy step queued on the kernel, fed by the previous step's argmax on the device when
        `input_ids` is None (no host round trip between steps; the runner's `decode_ahead`)."""
        slot = self.runner.decode_ahead(None if input_ids is None else input_ids.reshape(-1), state)
        return AheadStep(self.runner.buf["hidden_out"][:1], slot, self.runner.buf["logits"][:1])

    def ahead_token(self, step: AheadStep) -> int:
        return self.runner.ahead_token(step.token)

    @torch.inference_mode()
    def verify_greedy(
        self, input_ids: torch.Tensor, state: Any
    ) -> tuple[StepOutput, int, list[int], list[int]]:
        """Verify [pending, d1..dk] keeping every position reachable, accepting drafts on the device while
        each equals the argmax before it. Returns (output, accepted drafts, argmax per position, inputs)."""
        if not 2 <= input_ids.numel() <= MAX_TOKENS_PER_LAUNCH:  # more drafts than a launch takes
            return super().verify_greedy(input_ids, state)
        out = self.runner.step(input_ids.reshape(-1), state, keep_states=True, accept=True)
        assert out.inputs is not None
        # The hidden rows outlive the next launch (the kept drafts' MTP pairs): a copy. The logits are the
        # runner's buffer, which the next launch overwrites; greedy acceptance reads none of them, and a copy
        # would sit between the read-back and the next draft.
        return StepOutput(out.logits, out.hidden.clone()), out.accepted, out.tokens, out.inputs

    @torch.inference_mode()
    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, state: Any) -> StepOutput:
        if input_ids.numel() > MAX_TOKENS_PER_LAUNCH or not self.runner.has_mtp:
            return super().draft(input_ids, hidden, state)
        out = self.runner.mtp_step(input_ids.reshape(-1), hidden, state)
        return StepOutput(out.logits.clone(), out.hidden.clone())

    @torch.inference_mode()
    def draft_greedy(
        self, input_ids: torch.Tensor | Sequence[int], hidden: torch.Tensor, state: Any, k: int
    ) -> torch.Tensor:
        """The drafts as one chain of launches, each fed the argmax and hidden of the one before on the device
        (the runner's `mtp_chain`); pairs beyond one launch's go first, through `draft`. Host ids travel in the
        first launch's control block."""
        if not self.runner.has_mtp:
            return super().draft_greedy(input_ids, hidden, state, k)
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.reshape(-1)
        head = len(input_ids) - MAX_TOKENS_PER_LAUNCH
        if head > 0:
            ids = input_ids if isinstance(input_ids, torch.Tensor) else upload_ids(input_ids, self.device)
            self.draft(ids[:head].reshape(-1), hidden[:head], state)
            input_ids, hidden = input_ids[head:], hidden[head:]
        return self.runner.mtp_chain(input_ids, hidden, state, k, vocab=self.draft_vocab)

    def prepare(self, max_tokens: int, on_step: Callable[[int, int], None] | None = None) -> None:
        """Compile (or load from the disk cache) the builds of 1..max_tokens tokens per launch now, and the widest
        one that short prompts run as: a verify of k drafts takes k + 1 and a first draft step up to k + 1 pairs,
        and a build costs seconds to compile (they compile in parallel). `on_step(done, total)` hears each build
        done (worker/progress.py's step_reporter)."""
        widths = sorted(set(range(1, min(max_tokens, MAX_TOKENS_PER_LAUNCH) + 1)) | {MAX_TOKENS_PER_LAUNCH})
        self.runner.prepare(*widths, on_step=on_step)

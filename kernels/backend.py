"""The megakernel back end: the engine's `Backend` protocol (worker/backend.py) on the decode megakernel.

Plain decode (one token, no recorded DeltaNet history) is one megakernel launch. Prefill, verification of
several tokens with `keep_states`, MTP drafts and the state operations are the reference back end's (it is
the base class): multi-token launches and the MTP step on the megakernel are the speculative-decoding
issue. Both paths work on the same `SequenceState`, whose tensors the kernel reads and writes in place, so
switching between them costs nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from onestream.worker.backend import ReferenceBackend
from onestream.worker.model import StepOutput

from .build import Tuning
from .runtime import DEFAULT_TIMEOUT_S, MegakernelRunner


class MegakernelBackend(ReferenceBackend):
    name = "megakernel"

    def __init__(
        self, model: Any, *, tuning: Tuning | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        super().__init__(model)
        self.runner = MegakernelRunner(model, tuning=tuning, timeout_s=timeout_s)

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, state: Any, *, keep_states: bool = False) -> StepOutput:
        if keep_states or input_ids.numel() != 1:
            return super().decode(input_ids, state, keep_states=keep_states)
        out = self.runner.step(input_ids.reshape(1), state)
        return StepOutput(out.logits.clone(), out.hidden.clone())

    @torch.inference_mode()
    def decode_greedy(self, token: int, state: Any, n_tokens: int) -> list[int]:
        """`n_tokens` greedy tokens after `token`, chained on the device (one host sync at the end)."""
        return self.runner.greedy_chain(token, state, n_tokens)

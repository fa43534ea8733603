"""The engine's own host work per decode step and per speculative cycle, with a back end that does no model work.

`NullBackend` answers every call at once with fixed logits (token 5 always wins) and hiddens, and reports a
forced number of accepted drafts, so what the engine yields per chunk is timed with nothing but the engine loop,
the sequence, the drafting, the stop checker and the text decoder in it: the Python between launches that a
GPU back end adds to its launches (the runner's own launch work, `bind` and the control-block upload, is not in
it). On the CPU; the figures are host times of the machine it runs on.

    python tools/host_cycle.py [--k 3] [--tokens 400] [--no-draft-learner]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from onestream.worker.api import GenerateRequest, SamplingParams
from onestream.worker.backend import AheadStep
from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.engine import Engine
from onestream.worker.model import StepOutput

WINNER = 5


class NullState:
    def __init__(self) -> None:
        self.length = 0
        self.mtp_length = 0

    def nbytes(self) -> int:
        return 0


class NullBackend:
    name = "null"
    prefill_tokens = 512
    max_tokens_per_launch = 8
    draft_vocab = None

    def __init__(self, config: Any, accepted: int = 0) -> None:
        self.config = config
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.accepted = accepted
        rows = 8
        self.logits = torch.zeros(rows, config.vocab_size)
        self.logits[:, WINNER] = 1.0
        self.hidden = torch.zeros(512, config.hidden_size)

    @property
    def has_mtp(self) -> bool:
        return True

    def new_state(self, max_len: int) -> NullState:
        return NullState()

    def _out(self, n: int) -> StepOutput:
        return StepOutput(self.logits[: min(n, 8)], self.hidden[:n])

    def prefill(self, input_ids: torch.Tensor, state: NullState) -> StepOutput:
        state.length += input_ids.numel()
        return self._out(1)

    def decode(self, input_ids: torch.Tensor, state: NullState, *, keep_states: bool = False) -> StepOutput:
        state.length += input_ids.numel()
        return self._out(input_ids.numel())

    def decode_ahead(self, input_ids: torch.Tensor | None, state: NullState) -> AheadStep:
        state.length += 1
        return AheadStep(self.hidden[:1], WINNER, self.logits[:1])

    def ahead_token(self, step: AheadStep) -> int:
        return int(step.token)

    def verify_greedy(
        self, input_ids: torch.Tensor, state: NullState
    ) -> tuple[StepOutput, int, list[int], list[int]]:
        n = input_ids.numel()
        state.length += n
        inputs = input_ids.tolist()  # the one read-back of a cycle
        return self._out(n), min(self.accepted, n - 1), [WINNER] * n, inputs

    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, state: NullState) -> StepOutput:
        state.mtp_length += input_ids.numel()
        return self._out(input_ids.numel())

    def draft_greedy(
        self, input_ids: torch.Tensor | list[int], hidden: torch.Tensor, state: NullState, k: int
    ) -> torch.Tensor:
        state.mtp_length += len(input_ids) + k - 1
        return torch.full((k,), WINNER, dtype=torch.long)

    def rollback(self, state: NullState, n: int) -> None:
        state.length -= n

    def rollback_draft(self, state: NullState, n: int) -> None:
        state.mtp_length -= n

    def release(self, state: NullState) -> None:
        pass

    def snapshot(self, state: NullState, *, full: bool = False) -> tuple[int, int]:
        return state.length, state.mtp_length

    def restore(self, state: NullState, snap: tuple[int, int]) -> None:
        state.length, state.mtp_length = snap

    def nbytes(self, state_or_snapshot: Any) -> int:
        return 0


def gaps_ms(engine: Engine, tokens: int) -> list[float]:
    request = GenerateRequest(
        list(range(10, 42)), SamplingParams(temperature=0.0), max_tokens=tokens, ignore_eos=True
    )
    finished = list(engine.generate(request))[-1]
    return [1e3 * g for g in finished.timings.inter_token_s[2:]]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument(
        "--no-draft-learner",
        action="store_true",
        help="leave out the engine's DraftVocabulary (its cost per cycle: run with and without)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = open_checkpoint(None).config
    backend = NullBackend(config)
    engine = Engine(None, backend=backend, drafting="mtp", spec_k=0)  # type: ignore[arg-type]
    if args.no_draft_learner:
        engine.draft_vocabulary = None
    gaps_ms(engine, 50)  # warm-up
    plain = gaps_ms(engine, args.tokens)
    print(f"plain greedy (run ahead): {statistics.median(plain) * 1e3:.1f} us per token (median)")
    engine.spec_k = args.k
    for accepted in range(args.k + 1):
        backend.accepted = accepted
        gaps = gaps_ms(engine, args.tokens)
        print(
            f"k={args.k} a={accepted}: {statistics.median(gaps) * 1e3:.1f} us per cycle (median of {len(gaps)})"
        )


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t:.1f} s)")

"""What a verify pass of T tokens costs against a plain decode step, on the reference back end (CPU by
default): `python -m tools.verify_cost [--tokens 1 2 4 8 16 32] [--context 300] [--reps 15]`.

Copied drafts pay only where a longer verify costs less than the tokens it adds; this measures that cost
on the embedded model (or `--model DIR`). Each figure is the median over `--reps` passes at a context of
`--context` random tokens, in wall time and in this process's CPU time (the host may be shared); every
pass keeps one token and rolls the rest back, as a cycle that accepts nothing does.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from onestream.worker.engine import Engine
from onestream.worker.sequence import Sequence


def timed(call: Callable[[], torch.Tensor], reps: int) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds) of `call`, which returns a tensor to read back."""
    wall, cpu = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        float(call().reshape(-1)[0])
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 8, 12, 16, 24, 32])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = Engine(args.model, backend="reference", device=args.device, dtype="fp32")
    rng = random.Random(0)
    vocab = engine.config.vocab_size
    seq = Sequence(engine.backend, args.context + args.reps * (len(args.tokens) + 2) + 64, track_mtp=False)
    seq.feed([rng.randrange(vocab) for _ in range(args.context)])

    def plain() -> torch.Tensor:
        return seq.feed([rng.randrange(vocab)]).logits

    def verify(n: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            inputs = [rng.randrange(vocab) for _ in range(n)]
            out = seq.run_verify(seq.ids(inputs))
            seq.accept_verified(inputs, out, 1)
            return out.logits

        return run

    step_wall, step_cpu = timed(plain, args.reps)
    print(f"plain decode step: {step_wall * 1e3:.2f} ms wall, {step_cpu * 1e3:.2f} ms CPU")
    for n in args.tokens:
        wall, cpu = timed(verify(n), args.reps)
        print(
            f"verify T = {n:2d}: {wall * 1e3:6.2f} ms wall ({wall / step_wall:4.2f}x the step), "
            f"{cpu * 1e3:6.2f} ms CPU ({cpu / step_cpu:4.2f}x)"
        )


if __name__ == "__main__":
    main()

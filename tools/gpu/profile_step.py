"""One decode launch per tokens-per-launch build on a 27B-shaped random model, for a profiler to look at.

run (GPU machine, from the link tree of check_kernels.sh): ncu --clock-control none --kernel-name mk_decode \
    python3 tools/gpu/profile_step.py LAYERS scalar|mma T [T ...]
Each T's build is compiled and warmed first, so the profiled launches are one per T, in order.
"""

from __future__ import annotations

import sys

import torch
from onestream.kernels.benchmark import prefilled
from onestream.kernels.random_model import config_27b, random_model
from onestream.kernels.runtime import MegakernelRunner
from onestream.kernels.tuning import Tuning


def main() -> None:
    layers, gemv, tokens = int(sys.argv[1]), sys.argv[2], [int(t) for t in sys.argv[3:]]
    model = random_model(config_27b(layers), seed=7)
    runner = MegakernelRunner(model, tuning=Tuning(mma=gemv == "mma"))
    for t in tokens:
        runner.prepare(t)
    state, _, _ = prefilled(model, 64, 64 + 8 * len(tokens) + 8, seed=11)
    for t in tokens:
        ids = torch.randint(0, model.config.vocab_size, (t,), device="cuda")
        runner.step(ids, state.clone(), check=False)
        torch.cuda.synchronize()
        print(f"launched T={t}", flush=True)


if __name__ == "__main__":
    main()

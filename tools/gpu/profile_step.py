"""One decode launch per tokens-per-launch build on a 27B-shaped random model, for a profiler to look at.

run (GPU machine, from the link tree of check_kernels.sh): ncu --clock-control none --kernel-name mk_decode \
    python3 tools/gpu/profile_step.py LAYERS scalar|mma T [T ...] [--weights q4_k_m|q8_0|...]
With --weights the GEMV weights are random blocks of that preset (kernels/random_quant.py). Each T's build is compiled and warmed first, so the profiled launches are one per T, in order.
"""

from __future__ import annotations

import sys

import torch
from onestream.kernels.benchmark import prefilled
from onestream.kernels.random_model import config_27b, random_model
from onestream.kernels.random_quant import preset_types, quantize_randomly
from onestream.kernels.runtime import MegakernelRunner
from onestream.kernels.tuning import Tuning


def main() -> None:
    args = sys.argv[1:]
    weights = None
    if "--weights" in args:
        at = args.index("--weights")
        weights = args[at + 1]
        del args[at : at + 2]
    layers, gemv, tokens = int(args[0]), args[1], [int(t) for t in args[2:]]
    model = random_model(config_27b(layers), seed=7)
    if weights is not None:
        quantize_randomly(model, preset_types(model, weights), seed=8)
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

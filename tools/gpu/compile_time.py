"""How long a fresh card takes to compile its megakernel builds: one after another against in parallel.

Each mode runs in its own process with its own empty CuPy cache, so neither reads the other's binaries. The builds
are the ones a serving card's warm-up asks for (`MegakernelBackend.prepare`: 1..k + 1 tokens per launch and the
widest), on a 27B-shaped random model.

    python3 tools/gpu/compile_time.py --layers 2 --weights q4_k_m --widths 1 2 3 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def measure(layers: int, weights: str, widths: list[int], parallel: bool) -> dict[str, float]:
    import torch
    from onestream.kernels.random_model import config_27b
    from onestream.kernels.random_quant import random_model_in
    from onestream.kernels.runtime import MegakernelRunner

    model = random_model_in(config_27b(layers, mtp=True), weights)
    start = time.perf_counter()
    runner = MegakernelRunner(model)  # compiles the 1-token build
    first = time.perf_counter() - start
    start = time.perf_counter()
    rest = [n for n in widths if n != 1]
    if parallel:
        runner.prepare(*rest)
    else:
        for n in rest:
            runner.prepare(n)
    torch.cuda.synchronize()
    return {"first_s": first, "rest_s": time.perf_counter() - start, "builds": len(rest)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--mode", choices=("serial", "parallel"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(measure(args.layers, args.weights, args.widths, args.mode == "parallel")))
        return
    for mode in ("serial", "parallel"):
        with tempfile.TemporaryDirectory() as cache:
            cmd = [
                sys.executable,
                __file__,
                "--mode",
                mode,
                "--layers",
                str(args.layers),
                "--weights",
                args.weights,
            ]
            cmd += ["--widths", *map(str, args.widths)]
            out = subprocess.run(
                cmd, env={**os.environ, "CUPY_CACHE_DIR": cache}, capture_output=True, text=True
            )
            if out.returncode != 0:
                raise SystemExit(f"{mode} run failed:\n{out.stderr[-4000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{mode:8s} {args.weights}: the 1-token build {r['first_s']:.1f} s, then {r['builds']} more "
                f"{r['rest_s']:.1f} s ({os.cpu_count()} CPUs)"
            )


if __name__ == "__main__":
    main()

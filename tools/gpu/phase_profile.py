"""Where a decode step's time goes, per weights format and context: the per-phase breakdown of a timing build.

run (GPU machine, from the link tree of tools/gpu/env.sh):
    python3 tools/gpu/phase_profile.py --layers 16 --weights q4_k_m,bf16 --context 64,32768 [--tuning KEY=VALUE ...]

For every (format, context) a random 27B-shaped model of `--layers` layers (kernels/random_quant.py's blocks for a
quantization preset) runs a `Tuning(phase_timing=True)` build chained on the device (kernels/benchmark.py's
bench_megakernel); the stamps of its last launch give the per-phase table of kernels/phase_timing.py, with the
weight-streaming phases split into prologue, stream and epilogue. A timing build is slower than the default build
(its stamps), so its ms/token is printed beside the phases' sum; the phases' shares are what to read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from onestream.kernels.benchmark import bench_megakernel
from onestream.kernels.diagnostics import DiagnosticRunner
from onestream.kernels.phase_timing import format_breakdown, step_phases, summarise
from onestream.kernels.random_model import config_27b
from onestream.kernels.random_quant import random_model_in
from onestream.kernels.tuning import Tuning


def _field(text: str) -> tuple[str, int]:
    key, _, value = text.partition("=")
    if key not in {f.name for f in dataclasses.fields(Tuning)} or not value:
        raise argparse.ArgumentTypeError(f"--tuning wants a Tuning field KEY=VALUE, got {text!r}")
    return key, int(value)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--weights", default="bf16", help="comma-separated: bf16 or quantization presets")
    parser.add_argument("--context", default="64", help="comma-separated context lengths")
    parser.add_argument("--steps", type=int, default=16, help="chained steps per timed chain")
    parser.add_argument("--tuning", type=_field, action="append", default=[], help="Tuning field KEY=VALUE")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    config = config_27b(args.layers)
    tuning = Tuning(phase_timing=True, **dict(args.tuning))
    out = []
    for fmt in args.weights.split(","):
        model = random_model_in(config, fmt)
        runner = DiagnosticRunner(model, tuning=tuning)
        for context in (int(c) for c in args.context.split(",")):
            timed = bench_megakernel(runner, model, context, args.steps)[0]
            rows = summarise(runner.phase_stamps(), step_phases(config), runner.gemv_stamps())
            print(
                f"== {fmt}, {args.layers} layers, context {context}: {timed.ms_per_token:.3f} ms/token "
                f"(timing build), {runner.describe()}",
                flush=True,
            )
            print(format_breakdown(rows, timed.ms_per_token), flush=True)
            out.append(
                {
                    "weights": fmt,
                    "context": context,
                    "ms_per_token": timed.ms_per_token,
                    "phases": [dataclasses.asdict(r) for r in rows],
                }
            )
        del runner, model
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

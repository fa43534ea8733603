"""`onestream bench decode`: decode speed of the megakernel against the reference model (eager and in a CUDA
graph) and transformers' `generate`, on the 27B shapes (random bf16 weights) and on a small model, with the
copy and streaming-read bandwidth of the GPU measured in the same run. Needs a CUDA GPU and CuPy."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (GPU)", description=__doc__)
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True
    decode = sub.add_parser(
        "decode", help="decode tok/s and bandwidth, megakernel vs baselines", description=__doc__
    )
    decode.add_argument(
        "--layers", type=int, default=64, help="layers of the 27B-shaped model (64 = the real depth)"
    )
    decode.add_argument(
        "--context", type=int, default=64, help="prompt tokens before decoding (short context)"
    )
    decode.add_argument("--steps", type=int, default=64, help="decode steps timed for the megakernel")
    decode.add_argument("--ref-steps", type=int, default=16, help="decode steps timed for the baselines")
    decode.add_argument(
        "--small-model", default=None, help="checkpoint dir of the small model (default: tiny test config)"
    )
    decode.add_argument("--skip-27b", action="store_true", help="only the small model")
    decode.add_argument("--skip-hf", action="store_true", help="leave out transformers' generate")
    decode.add_argument(
        "--sweep",
        action="store_true",
        help="also time kernel variants (bf16 activations, fp32 GEMV inputs, dynamic row scheduling) and per-phase "
        "timing builds of the default and the dynamic kernel",
    )
    decode.add_argument("--json", default=None, help="write the results to this JSON file")
    decode.set_defaults(func=run_decode)


def run_decode(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("onestream bench decode: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    from onestream.kernels.benchmark import as_json, bench_model, format_results, measure_ceilings
    from onestream.kernels.build import Tuning
    from onestream.kernels.random_model import config_27b

    device = torch.cuda.get_device_name(0)
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings.copy_gbs:.0f} GB/s, read {ceilings.read_gbs:.0f} GB/s", flush=True)
    results = []
    if not args.skip_27b:
        tunings = {"default": Tuning()}
        if args.sweep:
            # Run 4: the numerics switch (the default keeps activations in fp32) and dynamic row scheduling.
            tunings["bf16 activations (run-3 numerics)"] = Tuning(fp32_act=False)
            tunings["dynamic rows (80 % static, 96 KB tiles)"] = Tuning(dynamic=True)
            tunings["fp32 GEMV inputs"] = Tuning(fp32_gemv_in=True)
            tunings["phase timing"] = Tuning(phase_timing=True)
            tunings["phase timing, dynamic rows"] = Tuning(dynamic=True, phase_timing=True)
        name = f"27B shapes ({args.layers} of 64 layers)" if args.layers != 64 else "27B shapes"
        results.append(
            bench_model(
                name,
                config_27b(args.layers),
                context=args.context,
                steps=args.steps,
                ref_steps=args.ref_steps,
                hf=not args.skip_hf,
                tunings=tunings,
            )
        )
        print(format_results(ceilings, results[-1:], device), flush=True)
        torch.cuda.empty_cache()
    from onestream.worker.loading import default_model_dir, load_model

    small_dir = Path(args.small_model) if args.small_model else default_model_dir()
    if (small_dir / "config.json").is_file() and any(small_dir.glob("*.safetensors")):
        small_model = load_model(small_dir, dtype=torch.bfloat16, device="cuda")
        small_config = small_model.config
        small_name = "embedded model" if not args.small_model else f"model {small_dir.name}"
    else:
        from onestream.worker.testing import tiny_config

        small_model, small_config, small_name = None, tiny_config(), "tiny test model (random weights)"
    results.append(
        bench_model(
            small_name,
            small_config,
            context=args.context,
            steps=args.steps * 4,
            ref_steps=args.ref_steps * 2,
            hf=not args.skip_hf,
            model=small_model,
        )
    )
    print()
    print(format_results(ceilings, results, device))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, **as_json(ceilings, results)}, indent=2))
    return 0

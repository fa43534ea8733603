"""The decode attention phase alone, per context: how fast it reads the KV cache (issue 24's long-context decode).

A random 27B-shaped model of 4 layers (layer 3 is full attention), its KV cache filled with random keys and values
up to each context, and the megakernel's attention phase of that layer launched alone (`DiagnosticRunner.run_phase`,
the phase the per-phase tests check against the reference), CUDA events around each call, which also uploads the
control block and reads it back. Per context: the phase's time, the key and value bytes it must read (kv heads x
positions x head dim x 2 x 2 bytes) over that time, as a share of the read ceiling measured in the same run, and the
items the plan cuts it into; then the marginal rate between the two longest contexts (the time per extra byte, which
leaves out the fixed part: the launch, the control block's round trip, the phase's set-up). Each `--tuning` names a
build to time beside the default one (KEY=VALUE[,KEY=VALUE]).

run (GPU machine, from the link tree of tools/gpu/env.sh):
    python3 tools/gpu/attention_phase.py --context 512,32768,131072 [--kv-cache int8] [--tuning g8:att_group=8]
        [--launches 9] [--warmup-s 0.5]
Each (build, context) first runs the phase untimed for --warmup-s seconds (under
`ncu --kernel-name mk_phase --launch-skip N`, 0 keeps the launches countable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def kv_bytes(config: Any, positions: int, kv_format: str = "auto") -> int:
    """Key and value bytes of one attention layer's cache over `positions` in `kv_format` (worker/kv_cache.py: bf16,
    or int8 levels with a scale per vector)."""
    from onestream.worker.kv_cache import kv_vector_bytes

    return 2 * config.num_key_value_heads * positions * kv_vector_bytes(kv_format, config.head_dim)


def marginal_gbs(rows: list[dict[str, Any]]) -> float | None:
    """GB/s of the extra bytes between the two longest contexts of one build (None with fewer than two)."""
    if len(rows) < 2:
        return None
    a, b = sorted(rows, key=lambda r: r["context"])[-2:]
    extra_s = (b["us"] - a["us"]) * 1e-6
    return (b["bytes"] - a["bytes"]) / extra_s / 1e9 if extra_s > 0 else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from onestream.worker.kv_cache import KV_FORMATS

    from onestream.commands.bench import tuning_changes

    def build(text: str) -> tuple[str, dict[str, Any]]:
        label, sep, fields = text.partition(":")
        if not sep or not label:
            raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL:KEY=VALUE,...")
        return label, tuning_changes(fields)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", default="512,32768,131072", help="comma-separated context lengths")
    p.add_argument("--kv-cache", choices=KV_FORMATS, default="auto", help="the cache's format (auto: bf16)")
    p.add_argument("--tuning", type=build, action="append", default=[], metavar="LABEL:KEY=VALUE,...")
    p.add_argument("--launches", type=int, default=9, help="timed launches per (build, context); the median")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=0.5,
        help="seconds of untimed launches before each (build, context): an idle card's clocks ramp up under them",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from onestream.kernels.benchmark import measure_ceilings
    from onestream.kernels.diagnostics import DiagnosticRunner
    from onestream.kernels.layout import Phase
    from onestream.kernels.random_model import config_27b, random_model
    from onestream.kernels.tuning import Tuning

    contexts = [int(x) for x in args.context.split(",") if x.strip()]
    config = config_27b(4)
    layer = config.full_attention_layers[0]
    model = random_model(config, seed=11)
    ceilings = measure_ceilings()
    print(f"device: {torch.cuda.get_device_name()}; read ceiling {ceilings.read_gbs:.0f} GB/s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(3)
    builds = {"default": {}, **dict(args.tuning)}
    kv = args.kv_cache
    results: dict[str, Any] = {"read_gbs": ceilings.read_gbs, "layer": layer, "kv_cache": kv, "builds": {}}
    for label, fields in builds.items():
        runner = DiagnosticRunner(model, tuning=Tuning(**fields), kv_cache=kv)
        rows = []
        for ctx in contexts:
            state = model.new_state(ctx + 8, kv_format=kv)
            cache = state.kv[layer]
            cache.reserve(ctx + 1)
            shape = (config.num_key_value_heads, ctx, config.head_dim)
            k = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
            cache.write(0, k, torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16))
            runner.buf["qkv_att"].normal_(generator=g)
            # The first launch loads the module; the card then runs the phase untimed for a while, since the
            # first builds of a run measured slow on a card that had idled.
            warm_until = time.perf_counter() + args.warmup_s
            runner.run_phase(Phase.ATT, layer, state, pos=ctx, tokens=[0])
            while time.perf_counter() < warm_until:
                runner.run_phase(Phase.ATT, layer, state, pos=ctx, tokens=[0])
            times = []
            for _ in range(args.launches):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                runner.run_phase(Phase.ATT, layer, state, pos=ctx, tokens=[0])
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            us = statistics.median(times)
            nbytes = kv_bytes(config, ctx + 1, kv)
            split = runner.plan.att_split(ctx + 1)
            row = {
                "context": ctx,
                "us": us,
                "bytes": nbytes,
                "gbs": nbytes / us / 1e3,
                "share_of_read": nbytes / us / 1e3 / ceilings.read_gbs,
                "split": split._asdict(),
            }
            rows.append(row)
            print(
                f"{label:>12s} context {ctx:>7d}: {us:9.1f} us, {nbytes / 1e6:8.1f} MB of keys and values, "
                f"{row['gbs']:7.1f} GB/s ({100 * row['share_of_read']:5.1f} % of read); items: {split}",
                flush=True,
            )
            del state, cache
        marginal = marginal_gbs(rows)
        if marginal is not None:
            print(
                f"{label:>12s} marginal rate between the two longest contexts: {marginal:.0f} GB/s "
                f"({100 * marginal / ceilings.read_gbs:.1f} % of read)",
                flush=True,
            )
        results["builds"][label] = {"tuning": fields, "rows": rows, "marginal_gbs": marginal}
        del runner
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_phase.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

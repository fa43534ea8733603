"""Plain decode through `Engine.generate` per kind of sampling, run ahead of the host and synchronised every step.

A random model of the 27B shapes (`--layers` layers, bf16; `RandomModelSource`, as the pool tools draw it), one
engine, greedy and sampled requests of `--tokens` tokens after a 32-token prompt of random ids (each request its
own prompt). Per sampling: decode tok/s over the chunks after the first (median of `--repeats` after a warm-up),
with the engine's default path (`Sequence.decode_run`: the step queued before the host reads the token) and with
the back end's queued step taken away (one synchronised step per token). `--profile LABEL` adds a
`torch.profiler` table of one request of that sampling (host and device time per op).

    PYTHONPATH=/tmp/onestream-pkg python3 tools/gpu/decode_sampling.py --layers 16 [--profile rp=1.15]
    python tools/gpu/decode_sampling.py --device cpu --tiny --layers 2      # the CPU check, any machine

Prints a table and writes decode_sampling.json under --out (default $OUT, else the working directory).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "rp=1.15": {"temperature": 0.0, "repetition_penalty": 1.15},
    "t=0.7 top-p": {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 1},
    "t=1 pp=0.5": {"temperature": 1.0, "presence_penalty": 0.5, "seed": 2},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="the tests' tiny shapes instead of the 27B ones")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", default="", help="a sampling label to profile one request of")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


def decode_rate(engine: Any, prompt: list[int], params: dict[str, Any], tokens: int) -> float:
    import torch
    from onestream.worker.api import GenerateRequest, SamplingParams, TokenChunk

    request = GenerateRequest(prompt, SamplingParams(**params), max_tokens=tokens, ignore_eos=True)
    stamps: list[tuple[float, int]] = []
    with torch.inference_mode():
        for item in engine.generate(request):
            if isinstance(item, TokenChunk):
                stamps.append((time.perf_counter(), len(item.token_ids)))
    decoded = sum(n for _, n in stamps[1:])
    return decoded / (stamps[-1][0] - stamps[0][0])


def main(argv: list[str] | None = None) -> int:
    import torch
    from onestream.cluster.engine_source import RandomModelSource

    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    source = RandomModelSource("tiny" if args.tiny else "27b", layers=args.layers)
    engine = source.build(
        device=args.device,
        dtype="fp32" if args.device == "cpu" else None,
        options={"spec_k": 0, "max_context": 32 + args.tokens + 64},
    )
    engine.warm_up()
    rng = random.Random(7)
    vocab = engine.config.vocab_size
    fresh = iter(lambda: [rng.randrange(16, vocab) for _ in range(32)], None)
    queued = engine.backend.decode_ahead
    rows = []
    for label, params in SAMPLINGS.items():
        row: dict[str, Any] = {"sampling": label, "params": params}
        for path, ahead in (("ahead", queued), ("synced", None)):
            engine.backend.decode_ahead = ahead  # None: Sequence.decode_run synchronises every step
            rates = [decode_rate(engine, next(fresh), params, args.tokens) for _ in range(args.repeats + 1)]
            row[path] = statistics.median(rates[1:])
        engine.backend.decode_ahead = queued
        rows.append(row)
    base = rows[0]["ahead"]
    print(
        f"decode through Engine.generate: random {'tiny' if args.tiny else '27B'} shapes, {args.layers} layers, "
        f"{args.device}, {args.tokens} tokens, median of {args.repeats}"
    )
    print(f"{'sampling':14s} {'ahead tok/s':>12s} {'synced':>8s} {'ahead/synced':>13s} {'vs greedy':>10s}")
    for r in rows:
        print(
            f"{r['sampling']:14s} {r['ahead']:12.1f} {r['synced']:8.1f} {r['ahead'] / r['synced']:13.3f} "
            f"{r['ahead'] / base:10.3f}"
        )
    result: dict[str, Any] = {"args": vars(args), "rows": rows, "backend": engine.backend.name}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=activities) as prof:
            decode_rate(engine, next(fresh), SAMPLINGS[args.profile], args.tokens)
        sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=25)
        print(table)
        result["profile"] = table
        host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(host)
        result["profile_host"] = host
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_sampling.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

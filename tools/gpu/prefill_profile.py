"""Where a short prompt's prefill spends its time, per weights format: one engine on a random model of the 27B
shapes, `Sequence.feed` of a `--tokens`-token prompt timed over `--repeats` fresh sessions, then a
`torch.profiler` table of one more (host and device time per op, most device time first, then most host time).

    PYTHONPATH=/tmp/onestream-pkg python3 tools/gpu/prefill_profile.py --layers 16 --weights q4_k_m --tokens 32

Writes prefill_profile.json under --out (default $OUT, else the working directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--weights", default="q4_k_m", help="bf16, or a preset's random GGUF blocks")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=30, help="rows of each profile table")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch
    from onestream.cluster.engine_source import RandomModelSource
    from onestream.worker.sequence import Sequence
    from torch.profiler import ProfilerActivity, profile

    args = parse_args(argv)
    source = RandomModelSource("27b", layers=args.layers, weights=args.weights)
    engine = source.build(device="cuda", options={"spec_k": 0, "max_context": args.tokens + 64})
    engine.warm_up()
    gen = torch.Generator().manual_seed(3)

    def prefill() -> float:
        seq = Sequence(engine.backend, args.tokens + 64, track_mtp=False)
        prompt = torch.randint(16, engine.config.vocab_size, (args.tokens,), generator=gen).tolist()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = seq.feed(prompt)
            out.logits[-1:].argmax(dim=-1).item()
        return time.perf_counter() - t0

    times = [prefill() for _ in range(args.repeats + 1)][1:]
    ms = 1e3 * statistics.median(times)
    print(
        f"prefill of {args.tokens} tokens, random 27B shapes, {args.layers} layers, {args.weights}, "
        f"{engine.backend.name}: {ms:.1f} ms median of {args.repeats} ({[round(1e3 * t, 1) for t in times]})"
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill()
    device = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows)
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    print(device)
    print(host)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_profile.json").write_text(
        json.dumps({"args": vars(args), "ms": ms, "times_s": times, "device": device, "host": host}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

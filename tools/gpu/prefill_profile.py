"""Prefill through the engine per weights format: one engine per format on a random model of the 27B shapes,
`Sequence.feed` of each `--tokens` prompt length timed over `--repeats` fresh sessions (after one warm-up), the
quantized formats' times stated against bf16's at the same length, then a `torch.profiler` table (host and
device time per op, most device time first, then most host time) of one more prefill of the shortest length.
`--paths fast,launches` times each length on both of the megakernel back end's prefill paths (the fast prefill,
and a short prompt's launches of 8 tokens, up to `--launches-max` tokens) instead of the engine's choice.
`--elementwise triton,torch` times the fast prefill with each form of its elementwise work
(worker/prefill/elementwise.py) in the same engine, the Triton kernels' times stated against the torch forms'.

    PYTHONPATH=/tmp/onestream-pkg python3 tools/gpu/prefill_profile.py --layers 16 --weights bf16,q4_k_m --tokens 32 8192

Writes prefill_profile.json under --out (default $OUT, else the working directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument(
        "--weights", default="bf16,q4_k_m", help="comma-separated: bf16, or presets' random GGUF blocks"
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=20, help="rows of each profile table")
    p.add_argument("--no-profile", action="store_true", help="time only")
    p.add_argument(
        "--paths", default="engine", help="engine (the back end's choice), or comma-separated: fast, launches"
    )
    p.add_argument("--launches-max", type=int, default=512, help="longest prompt timed as launches")
    p.add_argument(
        "--elementwise",
        default="",
        help="comma-separated forms of the fast prefill's elementwise work to time (triton, torch); "
        "empty: the engine's choice",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


def profile_one(engine: Any, tokens: int, rows: int) -> dict[str, str]:
    import torch
    from onestream.worker.sequence import Sequence
    from torch.profiler import ProfilerActivity, profile

    prompt = torch.randint(16, engine.config.vocab_size, (tokens,)).tolist()
    seq = Sequence(engine.backend, tokens + 64, track_mtp=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, torch.inference_mode():
        seq.feed(prompt).logits[-1:].argmax(dim=-1).item()
    averages = prof.key_averages()
    launches = sum(
        e.count for e in averages if getattr(getattr(e, "device_type", None), "name", "") == "CUDA"
    )
    return {
        "device": averages.table(sort_by="self_cuda_time_total", row_limit=rows),
        "host": averages.table(sort_by="self_cpu_time_total", row_limit=rows),
        "device_kernels": str(launches),
    }


def elementwise_form(name: str, chosen: Any) -> Any:
    """The fast prefill's elementwise form `name`: the engine's own where it is that one, else the torch forms."""
    from onestream.worker.prefill.elementwise import TorchElementwise

    if name == chosen.name:
        return chosen
    if name == "torch":
        return TorchElementwise()
    raise SystemExit(f"--elementwise {name}: the engine runs {chosen.name} here (its probe decides)")


def main(argv: list[str] | None = None) -> int:
    import torch
    from onestream.cluster.engine_source import RandomModelSource
    from onestream.worker.sequence import Sequence

    args = parse_args(argv)
    lengths = sorted(args.tokens)
    gen = torch.Generator().manual_seed(3)
    results: dict[str, Any] = {"args": vars(args), "runs": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base: dict[tuple[str, int], float] = {}  # bf16's ms by (path, tokens)
    fast: dict[tuple[int, str], float] = {}  # the fast path's ms by (tokens, weights)
    for weights in [w.strip() for w in args.weights.split(",") if w.strip()]:
        source = RandomModelSource("27b", layers=args.layers, weights=weights)
        engine = source.build(device="cuda", options={"spec_k": 0, "max_context": lengths[-1] + 64})
        engine.warm_up()
        backend = engine.backend
        chosen = getattr(backend, "launch_prefill_tokens", None)  # the engine's own bound, restored below
        if args.paths != "engine":
            backend.prepare(8)  # every launch size a prompt's remainder can take

        def prefill(tokens: int, engine: Any = engine) -> float:
            seq = Sequence(engine.backend, tokens + 64, track_mtp=False)
            prompt = torch.randint(16, engine.config.vocab_size, (tokens,), generator=gen).tolist()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                seq.feed(prompt).logits[-1:].argmax(dim=-1).item()
            return time.perf_counter() - t0

        chosen_ops = backend.fast_prefill.elementwise
        forms = {"": chosen_ops}
        if args.elementwise:
            names = sorted(
                args.elementwise.split(","), key=lambda name: name != "torch"
            )  # the baseline first
            forms = {name: elementwise_form(name, chosen_ops) for name in names}
        by_form: dict[tuple[str, int], float] = {}  # the torch forms' ms by (path, tokens)
        for form, ops in forms.items():
            backend.fast_prefill.elementwise = ops
            for path in args.paths.split(","):
                label = f"{path}, elementwise {ops.name}" if form else path
                for tokens in lengths:
                    if path == "launches" and (tokens > args.launches_max or form not in ("", "torch")):
                        continue
                    if path != "engine":
                        backend.launch_prefill_tokens = tokens if path == "launches" else 0
                    times = [prefill(tokens) for _ in range(args.repeats + 1)][1:]
                    ms = 1e3 * statistics.median(times)
                    key = (label, tokens)
                    if weights == "bf16":
                        base[key] = ms
                    against = (
                        f", {ms / base[key]:.3f}x bf16's time" if key in base and weights != "bf16" else ""
                    )
                    if path == "launches" and (tokens, weights) in fast:
                        against += f", {ms / fast[tokens, weights]:.3f}x the fast path's"
                    if path == "fast":
                        fast[tokens, weights] = ms
                    if form == "torch":
                        by_form[path, tokens] = ms
                    elif form and (path, tokens) in by_form:
                        against += f", {ms / by_form[path, tokens]:.3f}x the torch forms' time"
                    print(
                        f"prefill of {tokens} tokens, random 27B shapes, {args.layers} layers, {weights}, "
                        f"{backend.name}, {label} path: {ms:.1f} ms median of {args.repeats} = "
                        f"{1e3 * tokens / ms:,.0f} tok/s{against} ({[round(1e3 * t, 1) for t in times]})",
                        flush=True,
                    )
                    results["runs"].append(
                        {
                            "weights": weights,
                            "path": path,
                            "elementwise": ops.name,
                            "tokens": tokens,
                            "ms": ms,
                            "times_s": times,
                        }
                    )
        backend.fast_prefill.elementwise = chosen_ops
        if chosen is not None:
            backend.launch_prefill_tokens = chosen
        if not args.no_profile:
            tables = profile_one(engine, lengths[0], args.rows)
            print(f"{weights}, {lengths[0]} tokens: {tables['device_kernels']} device kernels")
            print(tables["device"])
            print(tables["host"])
            results.setdefault("profiles", []).append({"weights": weights, "tokens": lengths[0], **tables})
        (out / "prefill_profile.json").write_text(json.dumps(results, indent=1))
        del engine, source
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

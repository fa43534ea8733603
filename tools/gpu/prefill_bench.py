"""Prefill speed on the 27B shapes (random bf16 weights): the fast path (worker/prefill/) against the current
one (the reference model's step in 512-token pieces), both through `Sequence.feed` as the engine runs them.

    python3 tools/gpu/prefill_bench.py --lengths 4096,8192,16384,32768 --json OUT.json

Reports tok/s per prompt length and the share of the bf16 matrix peak measured in the same run (the best of
a few large bf16 GEMMs), counting the FLOPs of the projections, the causal attention and the chunked delta
rule. Then, as far as the time budget goes: the fast path with the torch delta rule, other piece sizes, and
per-layer timings of each SDPA kernel and delta-rule kernel, so that the defaults are chosen by measurement.
Results are written to the JSON file after every measurement (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from onestream.kernels.random_model import config_27b, random_model
from onestream.worker.backend import ReferenceBackend
from onestream.worker.config import ModelConfig
from onestream.worker.prefill import DeltaRuleKernel, FastPrefill, causal_attention
from onestream.worker.prefill.attention import SDPA_BACKENDS
from onestream.worker.sequence import Sequence

PEAK_SHAPES = ((8192, 8192, 8192), (16384, 5120, 17408), (16384, 17408, 5120))


def cuda_time(fn: Callable[[], Any], repeats: int = 1) -> float:
    """Best wall time of `fn` in seconds, synchronised (host overhead included, as a prompt sees it)."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def matrix_peak() -> dict[str, float]:
    """bf16 GEMM TFLOP/s of a few large shapes (the model's MLP shapes among them); the best is the peak."""
    out = {}
    for m, n, k in PEAK_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        a @ b
        seconds = cuda_time(lambda a=a, b=b: a @ b, repeats=5)
        out[f"{m}x{n}x{k}"] = 2 * m * n * k / seconds / 1e12
        del a, b
    return out


def layer_matrix_params(config: ModelConfig) -> int:
    """Weights every prompt token multiplies in the decoder layers (the lm_head runs for the last token)."""
    h, inter = config.hidden_size, config.intermediate_size
    mlp = 3 * h * inter
    att = h * (
        2 * config.num_attention_heads * config.head_dim + 2 * config.num_key_value_heads * config.head_dim
    )
    att += config.num_attention_heads * config.head_dim * h
    value = config.linear_num_value_heads * config.linear_value_head_dim
    dn = h * (config.linear_qkv_dim + value + 2 * config.linear_num_value_heads) + value * h
    full, linear = len(config.full_attention_layers), len(config.linear_attention_layers)
    return full * (att + mlp) + linear * (dn + mlp)


def prefill_flops(config: ModelConfig, tokens: int, chunk: int = 64) -> float:
    """FLOPs of a prompt from position 0: GEMMs, causal attention (half the square), the chunked delta rule."""
    gemm = 2.0 * layer_matrix_params(config) * tokens + 2.0 * config.hidden_size * config.vocab_size
    pairs = tokens * (tokens + 1) / 2
    attention = 4.0 * config.num_attention_heads * config.head_dim * pairs * len(config.full_attention_layers)
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    # per token and value head: the in-chunk products (k k^T, q k^T, scores @ v', the solve) and the state
    # products (w S, q S, k^T v')
    per_token = 2 * chunk * (2 * dk + dv) + chunk * (dk + dv) + 2 * 3 * dk * dv
    delta = float(per_token) * tokens * config.linear_num_value_heads * len(config.linear_attention_layers)
    return gemm + attention + delta


class Results:
    def __init__(self, path: Path | None, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {**header, "prefill": [], "sdpa": [], "delta_rule": []}

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.data[section].append(row)
        print(json.dumps(row), flush=True)
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1))


def time_prefill(backend: ReferenceBackend, ids: torch.Tensor, repeats: int) -> float:
    tokens = ids.tolist()

    def run() -> None:
        seq = Sequence(backend, len(tokens) + 16, track_mtp=False)
        seq.feed(tokens, ids=ids)

    return cuda_time(run, repeats)


def bench_sdpa(results: Results, config: ModelConfig, lengths: list[int]) -> None:
    """One attention layer's SDPA per kernel: a whole prompt from 0, and its last 8K piece over the cache."""
    nh, nkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    for total in lengths:
        for piece in sorted({total, min(8192, total)}):
            q = torch.randn(1, nh, piece, d, device="cuda", dtype=torch.bfloat16)
            kv = [torch.randn(1, nkv, total, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            flops = 4.0 * nh * d * (piece * (piece + 1) / 2 + piece * (total - piece))
            for name in ["auto", *SDPA_BACKENDS]:
                if name == "math" and total > 8192:
                    continue  # materialises the scores: minutes and tens of GB
                try:
                    seconds = cuda_time(
                        lambda name=name, q=q, kv=kv: causal_attention(q, kv[0], kv[1], d**-0.5, name), 3
                    )
                except RuntimeError as e:
                    results.add(
                        "sdpa", {"kernel": name, "context": total, "piece": piece, "error": str(e)[:160]}
                    )
                    continue
                row = {"kernel": name, "context": total, "piece": piece, "ms": seconds * 1e3}
                results.add("sdpa", {**row, "tflops": flops / seconds / 1e12})


def bench_delta_rule(results: Results, config: ModelConfig, tokens: int) -> None:
    hk, hv, dk = config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim
    bf = torch.bfloat16
    q, k = (torch.randn(tokens, hk, dk, device="cuda", dtype=bf) for _ in range(2))
    v = torch.randn(tokens, hv, config.linear_value_head_dim, device="cuda", dtype=bf)
    g = -torch.rand(tokens, hv, device="cuda")
    beta = torch.rand(tokens, hv, device="cuda", dtype=bf)
    for kind, chunk in [("fla", 64), ("torch", 64), ("torch", 128)]:
        try:
            kernel = DeltaRuleKernel(torch.device("cuda"), kind, chunk)
        except Exception as e:
            results.add("delta_rule", {"kernel": kind, "chunk": chunk, "error": str(e)[:160]})
            continue
        state = torch.zeros(hv, dk, dk, device="cuda")
        kernel(q, k, v, g, beta, state)
        seconds = cuda_time(lambda kernel=kernel, state=state: kernel(q, k, v, g, beta, state), 3)
        results.add(
            "delta_rule", {"kernel": kind, "chunk": chunk, "tokens": tokens, "ms_per_layer": seconds * 1e3}
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop starting measurements after this")
    parser.add_argument(
        "--pieces", default="4096,16384", help="other fast-path piece sizes to time at the longest length"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.perf_counter()

    def left() -> float:
        return args.budget_s - (time.perf_counter() - started)

    lengths = [int(x) for x in args.lengths.split(",")]
    peaks = matrix_peak()
    peak = max(peaks.values())
    config = config_27b(args.layers)
    results = Results(
        args.json,
        {
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "layers": args.layers,
            "matrix_peak_tflops": peaks,
            "layer_matrix_params": layer_matrix_params(config),
        },
    )
    print(f"bf16 matrix peak (measured): {peak:.0f} TFLOP/s {peaks}", flush=True)
    model = random_model(config, seed=11)
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompts = {n: torch.randint(0, config.vocab_size, (n,), device="cuda", generator=gen) for n in lengths}

    fast = ReferenceBackend(model, prefill="fast")
    reference = ReferenceBackend(model, prefill="reference")
    warm = prompts[lengths[0]][:1024]
    for backend in (fast, reference):  # compiles fla's Triton kernels, cuBLAS heuristics, the allocator
        time_prefill(backend, warm, 1)
    print(f"fast path: {fast.fast_prefill.description}, {fast.prefill_tokens} tokens per call", flush=True)

    def measure(label: str, backend: ReferenceBackend, n: int, repeats: int) -> float:
        seconds = time_prefill(backend, prompts[n], repeats)
        flops = prefill_flops(config, n)
        row = {
            "path": label,
            "tokens": n,
            "piece": backend.prefill_tokens,
            "seconds": seconds,
            "tok_s": n / seconds,
            "tflops": flops / seconds / 1e12,
            "pct_peak": 100.0 * flops / seconds / 1e12 / peak,
        }
        results.add("prefill", row)
        return seconds

    ref_rate = None
    for n in lengths:
        measure(f"fast ({fast.fast_prefill.description})", fast, n, 2 if n <= 8192 else 1)
    for n in lengths:
        if ref_rate is not None and n / ref_rate > left():
            results.add("prefill", {"path": "reference", "tokens": n, "skipped": "time budget"})
            continue
        ref_rate = n / measure("reference (current path)", reference, n, 1)
    if left() > 20:
        bench_delta_rule(results, config, 8192)
    if left() > 20:
        bench_sdpa(results, config, [8192, lengths[-1]])
    longest = lengths[-1]
    if fast.fast_prefill.delta_rule.name != "torch" and left() > 30:
        torch_path = ReferenceBackend(model, prefill="fast")
        torch_path.fast_prefill = FastPrefill(model, deltanet="torch")
        measure(f"fast ({torch_path.fast_prefill.description})", torch_path, 8192, 1)
    for piece in [int(x) for x in args.pieces.split(",") if x]:
        if left() < 25:
            break
        fast.prefill_tokens = piece
        measure(f"fast ({fast.fast_prefill.description})", fast, longest, 1)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

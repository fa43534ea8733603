"""Prefill speed on the 27B shapes (random bf16 weights): the fast path (worker/prefill/) against the current
one (the reference model's step in 512-token pieces), both through `Sequence.feed` as the engine runs them.

    python3 tools/gpu/prefill_bench.py --lengths 4096,8192,16384,32768 --json OUT.json
    python3 tools/gpu/prefill_bench.py --lengths 8192 --weights bf16,q4_k_m --json OUT.json

`--weights` times the fast path per weights format in one run: bf16, then each preset's random GGUF blocks
(kernels/random_quant.py, typed tensor by tensor as the preset types a file) on a fresh model, each matrix
dequantized on the device into the prefill's scratch right before its GEMM; a quantized row carries its
rate against bf16's at the same length, and is timed again with the torch codec as the dequantizer; one pass
of each dequantizer over every layer matrix is timed on its own ("dequant").

Reports tok/s per prompt length and the share of the bf16 matrix peak measured in the same run (the best of
a few large bf16 GEMMs), counting the FLOPs of the projections, the causal attention and the chunked delta
rule. Then, as far as the time budget goes: the fast path with the torch delta rule, with the torch forms of
the elementwise work (worker/prefill/elementwise.py) in place of the Triton kernels, other piece sizes, and
per-layer timings of each SDPA kernel and delta-rule kernel, so that the defaults are chosen by measurement.
The bf16 extras run only while time is left for the quantized formats after them.
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
from onestream.kernels.random_quant import preset_types, quantize_randomly
from onestream.worker.backend import ReferenceBackend
from onestream.worker.config import ModelConfig
from onestream.worker.prefill import DeltaRuleKernel, FastPrefill, causal_attention
from onestream.worker.prefill.attention import SDPA_BACKENDS
from onestream.worker.quant import PRESETS, QuantizedLinear, quantized_nbytes
from onestream.worker.sequence import Sequence

PEAK_SHAPES = ((8192, 8192, 8192), (16384, 5120, 17408), (16384, 17408, 5120))
DEVICE = "cuda"  # where the prompts are drawn (a smoke run of the bench's logic on the CPU sets "cpu")
# what one quantized format's build, warm-up and timings take: kept back from the bf16 extras
QUANT_RESERVE_S = 45.0


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
        self.data: dict[str, Any] = {**header, "prefill": [], "sdpa": [], "delta_rule": [], "dequant": []}

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


def time_dequant(results: Results, model: Any, fast: FastPrefill, weights: str) -> None:
    """One pass of the prefill's dequantizer over every quantized layer matrix (what a piece pays besides its
    GEMMs), through the fast path's own scratch."""
    scratch = fast.scratch
    head = fast._head()
    mats = [m.quantized for m in model.modules() if isinstance(m, QuantizedLinear) and m is not head]
    mats = [w for w in mats if w.shape[0] * w.shape[1] <= scratch.buffer.numel()]
    seconds = cuda_time(lambda: [scratch.fill(w, 0, w.shape[0]) for w in mats], repeats=2)
    elements = sum(w.shape[0] * w.shape[1] for w in mats)
    read = sum(w.nbytes for w in mats)
    row = {"weights": weights, "decoder": scratch.description, "matrices": len(mats), "seconds": seconds}
    written = elements * scratch.buffer.element_size()
    results.add(
        "dequant",
        {**row, "gb_read": read / 1e9, "gb_written": written / 1e9, "gb_s": (read + written) / seconds / 1e9},
    )


def bf16_extras(
    results: Results,
    model: Any,
    fast: ReferenceBackend,
    config: ModelConfig,
    lengths: list[int],
    pieces: str,
    measure: Callable[[str, ReferenceBackend, int, int, str], float],
    left: Callable[[], float],
) -> None:
    """The current path, the kernel sweeps and the other piece sizes, as far as `left()` allows."""
    reference = ReferenceBackend(model, prefill="reference")
    if left() > 20:
        time_prefill(reference, torch.zeros(1024, dtype=torch.long, device=model.device), 1)
    ref_rate = None
    for n in lengths:
        if left() < 20 or (ref_rate is not None and n / ref_rate > left()):
            results.add("prefill", {"path": "reference", "tokens": n, "skipped": "time budget"})
            continue
        ref_rate = n / measure("reference (current path)", reference, n, 1, "bf16")
    if left() > 20:
        bench_delta_rule(results, config, 8192)
    if left() > 20:
        bench_sdpa(results, config, [8192, lengths[-1]])
    longest = lengths[-1]
    if fast.fast_prefill.delta_rule.name != "torch" and left() > 30:
        torch_path = ReferenceBackend(model, prefill="fast")
        torch_path.fast_prefill = FastPrefill(model, deltanet="torch")
        measure(f"fast ({torch_path.fast_prefill.description})", torch_path, 8192, 1, "bf16")
    if fast.fast_prefill.elementwise.name != "torch" and left() > 30:
        torch_forms = ReferenceBackend(model, prefill="fast")
        torch_forms.fast_prefill = FastPrefill(model, elementwise="torch")
        measure(f"fast ({torch_forms.fast_prefill.description})", torch_forms, 8192, 1, "bf16")
    default_piece = fast.prefill_tokens
    for piece in [int(x) for x in pieces.split(",") if x]:
        if left() < 25:
            break
        fast.prefill_tokens = piece
        measure(f"fast ({fast.fast_prefill.description})", fast, longest, 1, "bf16")
    fast.prefill_tokens = default_piece


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
    parser.add_argument(
        "--weights",
        default="bf16",
        help="comma-separated weights formats: bf16 and/or quantization presets (q4_k_m, q5_k_m, q6_k, q8_0)",
    )
    args = parser.parse_args(argv)
    formats = [w.strip().lower() for w in args.weights.split(",") if w.strip()]
    if not formats or any(f != "bf16" and f not in PRESETS for f in formats):
        print(
            f"prefill_bench: --weights takes bf16 or {', '.join(PRESETS)}, got {args.weights!r}",
            file=sys.stderr,
        )
        return 2
    if "bf16" in formats:  # first: the quantized rows are stated against it
        formats.remove("bf16")
        formats.insert(0, "bf16")
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
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    prompts = {n: torch.randint(0, config.vocab_size, (n,), device=DEVICE, generator=gen) for n in lengths}
    bf16_rates: dict[int, float] = {}

    def measure(label: str, backend: ReferenceBackend, n: int, repeats: int, weights: str) -> float:
        seconds = time_prefill(backend, prompts[n], repeats)
        flops = prefill_flops(config, n)
        row = {
            "path": label,
            "weights": weights,
            "tokens": n,
            "piece": backend.prefill_tokens,
            "seconds": seconds,
            "tok_s": n / seconds,
            "tflops": flops / seconds / 1e12,
            "pct_peak": 100.0 * flops / seconds / 1e12 / peak,
        }
        if weights == "bf16" and label.startswith("fast") and n not in bf16_rates:
            bf16_rates[n] = n / seconds
        elif weights != "bf16" and n in bf16_rates:
            row["ratio_to_bf16"] = n / seconds / bf16_rates[n]
        results.add("prefill", row)
        return seconds

    for index, weights in enumerate(formats):
        reserve = QUANT_RESERVE_S * sum(1 for f in formats[index + 1 :] if f != "bf16")
        model = random_model(config, seed=11)
        if weights != "bf16":
            quantize_randomly(model, preset_types(model, weights), seed=8)
            torch.cuda.empty_cache()
            print(f"{weights}: {quantized_nbytes(model) / 2**30:.2f} GiB of GGUF blocks", flush=True)
        fast = ReferenceBackend(model, prefill="fast")
        warm = prompts[lengths[0]][:1024]
        time_prefill(fast, warm, 1)  # compiles fla's and the dequantizer's kernels, cuBLAS heuristics
        print(
            f"{weights} fast path: {fast.fast_prefill.description}, {fast.prefill_tokens} tokens per call",
            flush=True,
        )
        for n in lengths:
            measure(f"fast ({fast.fast_prefill.description})", fast, n, 2 if n <= 8192 else 1, weights)
        if weights == "bf16":
            bf16_extras(
                results, model, fast, config, lengths, args.pieces, measure, lambda r=reserve: left() - r
            )
        elif fast.fast_prefill.scratch is not None and left() > 20 + reserve:
            time_dequant(results, model, fast.fast_prefill, weights)
            codec = ReferenceBackend(model, prefill="fast")
            codec.fast_prefill = FastPrefill(model, dequant="torch")
            time_prefill(codec, warm, 1)
            n = 8192 if 8192 in prompts else lengths[0]
            measure(f"fast ({codec.fast_prefill.description})", codec, n, 1, weights)
            time_dequant(results, model, codec.fast_prefill, weights)
            del codec
        del fast, model
        torch.cuda.empty_cache()
    for weights in formats[1:] if formats[0] == "bf16" else []:
        for row in results.data["prefill"]:
            if row.get("weights") == weights and "ratio_to_bf16" in row:
                print(
                    f"{weights} / bf16 at {row['tokens']} tokens: {row['ratio_to_bf16']:.3f} ({row['path']})"
                )
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

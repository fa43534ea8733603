"""`onestream bench decode --context A,B,...`: the megakernel's decode speed against the context length.

Per weights format (bf16, or a quantization preset's random GGUF blocks as in bench_quant.py) one model and one
runner; per context a state whose KV caches hold that many positions of random keys and values (the work of a
decode step does not depend on their values, and a real prefill of 128K tokens would take most of a device call),
timed as device-chained greedy decode (median of 3 chains). A row gives tok/s, the bytes a step must stream (the
weights, the DeltaNet state, the KV cache read at that context), their share of the read ceiling measured in the
same run, the speed relative to the shortest context of the same format and build (`builds`: the default
and each `bench decode --variant`, timed on the same model), and the most that ratio can be: the shortest
context's bytes over this one's (both streamed at one rate), so that a target above it needs fewer bytes (a
smaller KV cache), not a faster kernel. Each KV cache format asked for (`kv_caches`: the model's dtype, int8) is
timed on its own runner and compared with the shortest context of the same format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from onestream.worker.config import ModelConfig
from onestream.worker.kv_cache import DEFAULT_KV_FORMAT

from .benchmark import Ceilings, _state_bytes, events_time
from .random_quant import random_model_in
from .runtime import MegakernelRunner
from .tuning import Tuning


@dataclass
class ContextResult:
    weights: str
    context: int
    tok_s: float | None
    ms_per_token: float | None
    bytes_per_token: int
    note: str = ""
    build: str = "default"
    kv_cache: str = DEFAULT_KV_FORMAT

    def read_share(self, ceilings: Ceilings) -> float | None:
        if self.tok_s is None:
            return None
        return self.bytes_per_token * self.tok_s / (ceilings.read_gbs * 1e9)


def _shortest(rows: list[ContextResult], r: ContextResult) -> ContextResult | None:
    """The shortest timed context of r's format, build and KV cache (rows are shortest first)."""
    key = (r.weights, r.build, r.kv_cache)
    return next((b for b in rows if (b.weights, b.build, b.kv_cache) == key and b.tok_s), None)


def byte_bound(rows: list[ContextResult], r: ContextResult) -> float | None:
    """The most r's speed can be against the shortest context's: their bytes per token in inverse ratio."""
    base = _shortest(rows, r)
    return base.bytes_per_token / r.bytes_per_token if base and r.bytes_per_token else None


@torch.no_grad()
def synthetic_state(
    model: Any, context: int, max_len: int, *, seed: int, kv_format: str = DEFAULT_KV_FORMAT
) -> Any:
    """A state at `context` positions: random keys and values in every KV cache (of `kv_format`; room for
    `max_len` reserved, so nothing reallocates in a timed chain), small random DeltaNet states, random token
    ids."""
    c = model.config
    dev = model.device
    g = torch.Generator(device=dev).manual_seed(seed)
    state = model.new_state(max_len, kv_format=kv_format)
    shape = (c.num_key_value_heads, context, c.head_dim)
    for cache in state.kv.values():
        cache.reserve(max_len)
        k = torch.randn(shape, generator=g, device=dev, dtype=model.dtype)
        cache.write(0, k, torch.randn(shape, generator=g, device=dev, dtype=model.dtype))
    for rec in state.recurrent.values():
        rec.normal_(std=0.02, generator=g)
    state.advance(torch.randint(0, c.vocab_size, (context,), device=dev, generator=g))
    return state


def time_context(runner: MegakernelRunner, model: Any, context: int, steps: int) -> tuple[float, float]:
    """(tok/s, ms per token) of `steps` device-chained greedy launches from `context` positions."""
    state = synthetic_state(model, context, context + 4 * steps + 8, seed=context, kv_format=runner.kv_cache)
    runner.greedy_chain(1, state, 2)  # warm-up (module load, tables) and a real token to chain from
    token = state.token_ids[-1]

    def chain() -> None:
        runner.greedy_chain(token, state, steps, check=False)

    t = events_time(chain, 3) / steps
    runner._check(runner.ctrl.cpu())
    return 1 / t, t * 1e3


def bench_contexts(
    config: ModelConfig,
    formats: list[str],
    contexts: list[int],
    *,
    steps: int,
    tuning: Tuning | None = None,
    variants: dict[str, Tuning] | None = None,
    kv_caches: tuple[str, ...] = (DEFAULT_KV_FORMAT,),
) -> list[ContextResult]:
    """Each weights format's builds (the default `tuning`, then each of `variants`) for each KV cache format at
    every context, shortest first (one model in memory at a time, one runner at a time)."""
    builds = {"default": tuning, **(variants or {})}
    out = []
    for fmt in formats:
        model = random_model_in(config, fmt)
        for (label, build), kv in ((b, kv) for b in builds.items() for kv in kv_caches):
            try:
                runner = MegakernelRunner(model, tuning=build, kv_cache=kv)
            except Exception as e:
                note = f"failed: {type(e).__name__}: {e}"[:300]
                out += [
                    ContextResult(fmt, n, None, None, 0, note, build=label, kv_cache=kv)
                    for n in sorted(contexts)
                ]
                torch.cuda.empty_cache()
                continue
            weights = runner.weights.gemv_bytes + config.hidden_size * 2  # and one embedding row
            for context in sorted(contexts):
                bytes_per_token = weights + _state_bytes(config, context, kv)
                row = ContextResult(fmt, context, None, None, bytes_per_token, build=label, kv_cache=kv)
                try:
                    row.tok_s, row.ms_per_token = time_context(runner, model, context, steps)
                except Exception as e:
                    row.note = f"failed: {type(e).__name__}: {e}"[:300]
                out.append(row)
                print(
                    f"  [{fmt}, {label}, kv {kv}, context {context}] {row.tok_s} tok/s {row.note}", flush=True
                )
                torch.cuda.empty_cache()
            del runner
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    return out


def format_contexts(ceilings: Ceilings, rows: list[ContextResult], title: str) -> str:
    lines = [
        f"== {title}: decode against the context length (device-chained greedy)",
        f"   {'weights':8s} {'build':12s} {'kv':4s} {'context':>8s} {'tok/s':>8s} {'ms/tok':>8s} {'GB/token':>9s} "
        f"{'%read':>6s} {'x shortest':>10s} {'bytes allow':>11s}",
    ]
    for r in rows:
        if r.tok_s is None:
            lines.append(
                f"   {r.weights:8s} {r.build[:12]:12s} {r.kv_cache:4s} {r.context:8d} {'-':>8s} {'-':>8s}  {r.note}"
            )
            continue
        base, bound = _shortest(rows, r), byte_bound(rows, r)
        ratio = f"{r.tok_s / base.tok_s:10.3f}" if base else f"{'-':>10s}"  # base: timed, by _shortest
        allow = f"{bound:11.3f}" if bound else f"{'-':>11s}"
        lines.append(
            f"   {r.weights:8s} {r.build[:12]:12s} {r.kv_cache:4s} {r.context:8d} {r.tok_s:8.1f} {r.ms_per_token:8.3f} "
            f"{r.bytes_per_token / 1e9:9.3f} {100 * (r.read_share(ceilings) or 0.0):6.1f} {ratio} {allow}"
        )
    return "\n".join(lines)


def contexts_json(ceilings: Ceilings, rows: list[ContextResult]) -> dict[str, Any]:
    return {
        "ceilings": dataclasses.asdict(ceilings),
        "contexts": [
            {**dataclasses.asdict(r), "read_share": r.read_share(ceilings), "byte_bound": byte_bound(rows, r)}
            for r in rows
        ],
    }

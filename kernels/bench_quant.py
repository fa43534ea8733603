"""`onestream bench decode --weights`: the megakernel's decode speed per weight format on the 27B shapes.

Each format is a random model (bf16: random_model.py; q4_k_m, q8_0, ...: the same with its GEMV weights replaced by
random GGUF blocks typed by the preset's rule, random_quant.py), timed as device-chained greedy decode. A row gives
tok/s, the bytes a step must stream (every GEMV weight in its stored format, one embedding row, the DeltaNet
state and the KV cache read at the context), that as a share of the read ceiling measured in the same run, and
the speed relative to the bf16 build of the same run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from onestream.worker.config import ModelConfig

from .benchmark import Ceilings, _state_bytes, bench_megakernel
from .diagnostics import DiagnosticRunner
from .random_quant import random_model_in
from .tuning import Tuning

BF16 = "bf16"


@dataclass
class WeightsResult:
    weights: str
    tok_s: float | None
    ms_per_token: float | None
    bytes_per_token: int
    weight_bytes: int
    kernel: dict[str, Any]
    note: str = ""

    def read_share(self, ceilings: Ceilings) -> float | None:
        if self.tok_s is None:
            return None
        return self.bytes_per_token * self.tok_s / (ceilings.read_gbs * 1e9)


def bench_weights(
    config: ModelConfig, formats: list[str], *, context: int, steps: int, tuning: Tuning | None = None
) -> list[WeightsResult]:
    """Time each weights format's build in turn (one model in memory at a time)."""
    out = []
    for fmt in formats:
        model = random_model_in(config, fmt)
        try:
            runner = DiagnosticRunner(model, tuning=tuning)
        except Exception as e:
            out.append(WeightsResult(fmt, None, None, 0, 0, {}, f"failed: {type(e).__name__}: {e}"[:300]))
            del model
            torch.cuda.empty_cache()
            continue
        weights = runner.weights.gemv_bytes + config.hidden_size * 2  # and one embedding row
        row = WeightsResult(
            fmt, None, None, weights + _state_bytes(config, context), weights, runner.describe()
        )
        try:
            timed = bench_megakernel(runner, model, context, steps)[0]
            row.tok_s, row.ms_per_token = timed.tok_s, timed.ms_per_token
        except Exception as e:
            row.note = f"failed: {type(e).__name__}: {e}"[:300]
        out.append(row)
        print(f"  [{fmt}] {row.tok_s} tok/s {row.note}", flush=True)
        del runner, model
        torch.cuda.empty_cache()
    return out


def format_weights(ceilings: Ceilings, rows: list[WeightsResult], title: str) -> str:
    base = next((r.tok_s for r in rows if r.weights == BF16 and r.tok_s), None)
    lines = [
        f"== {title}: decode per weights format (device-chained greedy)",
        f"   {'weights':10s} {'tok/s':>8s} {'ms/tok':>8s} {'GB/token':>9s} {'%read':>6s} {'x bf16':>7s}",
    ]
    for r in rows:
        if r.tok_s is None:
            lines.append(f"   {r.weights:10s} {'-':>8s} {'-':>8s} {r.bytes_per_token / 1e9:9.3f}  {r.note}")
            continue
        share = r.read_share(ceilings) or 0.0
        ratio = f"{r.tok_s / base:7.2f}" if base else f"{'-':>7s}"
        lines.append(
            f"   {r.weights:10s} {r.tok_s:8.1f} {r.ms_per_token:8.3f} {r.bytes_per_token / 1e9:9.3f} "
            f"{100 * share:6.1f} {ratio}"
        )
    for r in rows:
        if r.kernel:
            lines.append(f"   kernel [{r.weights}]: {r.kernel}")
    return "\n".join(lines)


def weights_json(ceilings: Ceilings, rows: list[WeightsResult]) -> dict[str, Any]:
    return {
        "ceilings": dataclasses.asdict(ceilings),
        "weights": [{**dataclasses.asdict(r), "read_share": r.read_share(ceilings)} for r in rows],
    }

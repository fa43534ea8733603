"""Alternated timing of kernel builds: separates a build's effect from run-to-run spread.

Two builds timed in separate runs (or one after the other, once each) can differ by several percent with no
change at all (docs/benchmarks.md has such a run). Here every build is timed once
per round, the order rotating from round to round, all on the same model, state and context; the spread of a
build's rounds shows the noise its difference from another build must exceed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class AlternatedResult:
    label: str
    ms_per_token: list[float] = field(default_factory=list)  # one figure per round, in round order
    error: str = ""

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.ms_per_token) if self.ms_per_token else None

    @property
    def spread_pct(self) -> float | None:
        """(max - min) / median of the rounds, in percent."""
        m = self.median_ms
        if not m:
            return None
        return 100.0 * (max(self.ms_per_token) - min(self.ms_per_token)) / m


def round_orders(labels: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of each round: the labels rotated by one per round, so no build is always first or last."""
    n = len(labels)
    return [[labels[(r + i) % n] for i in range(n)] for r in range(rounds)] if n else []


def alternate(timers: dict[str, Callable[[], float]], rounds: int) -> list[AlternatedResult]:
    """Call each timer (returns ms per token) once per round, in rotating order; a timer that raises is
    reported and left out of later rounds."""
    results = {label: AlternatedResult(label) for label in timers}
    for order in round_orders(list(timers), rounds):
        for label in order:
            result = results[label]
            if result.error:
                continue
            try:
                result.ms_per_token.append(timers[label]())
            except Exception as e:  # one failing build must not end the comparison
                result.error = f"{type(e).__name__}: {e}"[:300]
    return list(results.values())


def format_alternated(results: Sequence[AlternatedResult], floor_ms: float | None = None) -> str:
    """A table: median ms/token, tok/s, the rounds' spread, the ratio to the first build (and to the floor)."""
    base = results[0].median_ms if results else None
    head = f"   {'build':44s} {'median ms':>9s} {'tok/s':>7s} {'spread':>7s} {'vs first':>8s}"
    lines = [head + (f" {'% floor':>7s}" if floor_ms else "") + "  rounds (ms/token)"]
    for r in results:
        m = r.median_ms
        if m is None:
            lines.append(f"   {r.label:44s} {'-':>9s}  {r.error}")
            continue
        ratio = f"{base / m:7.3f}x" if base else "      -"
        line = f"   {r.label:44s} {m:9.3f} {1e3 / m:7.1f} {r.spread_pct:6.1f}% {ratio}"
        if floor_ms:
            line += f" {100 * floor_ms / m:6.1f}%"
        rounds = " ".join(f"{x:.3f}" for x in r.ms_per_token)
        lines.append(line + "  " + rounds + (f"  (then failed: {r.error})" if r.error else ""))
    return "\n".join(lines)

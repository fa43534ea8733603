"""Where a decode step's time goes: per-phase figures from the stamps of a timing build of the megakernel.

A build with `Tuning(phase_timing=True)` makes every block record, for every phase of the step, the
globaltimer when it began the phase (kernel start or leaving the previous barrier) and when its own work
in it ended (arrival at the next barrier). From those: the phase's span (first start to the next phase's
first start: work plus barrier), its critical path (first start to the last block's end), the mean time a
block was busy, the finishing spread across blocks (tail / imbalance), and the barrier gap (the last
arrival to the first departure).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onestream.worker.config import ModelConfig

from .layout import Phase
from .plan import att_split, launch_steps
from .tuning import Tuning

# The name a breakdown gives each phase.
PHASE_NAMES = {phase: phase.name.lower() for phase in Phase} | {Phase.ATT: "attention"}


def step_phases(config: ModelConfig) -> list[str]:
    """The phase name of every step of a main-model launch, in order (the plan's step list)."""
    return [PHASE_NAMES[step.phase] for step in launch_steps(config)]


@dataclass
class PhaseRow:
    name: str
    count: int  # phases of this kind in one step
    total_us: float  # sum of spans
    span_us: float  # per phase: start to the next phase's start
    critical_us: float  # per phase: first start to the last block's end
    busy_us: float  # per phase: mean over blocks of (end - start)
    spread_us: float  # per phase: last block's end minus first block's end
    barrier_us: float  # per phase: last end to the next phase's first start
    # Weight-streaming phases, given the GEMV stamps (means over the blocks that ran a GEMV): start to the stream's
    # start (the prologue: staging the input), the stream (to the end of the last round's multiplies), and from
    # there to the end (the last round's reduction and epilogue). None for the other phases.
    prologue_us: float | None = None
    stream_us: float | None = None
    epilogue_us: float | None = None


def summarise(stamps: np.ndarray, names: list[str], gemv: np.ndarray | None = None) -> list[PhaseRow]:
    """Per-kind figures from stamps [steps, blocks, (start, end)] in ns; kinds in order of first appearance.
    `gemv` (same shape: stream start, last round's stream end; 0 where a block ran no GEMV) adds the split of
    the weight-streaming phases into prologue, stream and epilogue."""
    if stamps.ndim != 3 or stamps.shape[2] != 2 or stamps.shape[0] != len(names):
        raise ValueError(f"stamps of shape {stamps.shape} do not match {len(names)} phases x blocks x 2")
    if gemv is not None and gemv.shape != stamps.shape:
        raise ValueError(f"GEMV stamps of shape {gemv.shape} do not match the phase stamps' {stamps.shape}")
    t = stamps.astype(np.float64) / 1e3
    start_min = t[:, :, 0].min(axis=1)
    end_max = t[:, :, 1].max(axis=1)
    end_min = t[:, :, 1].min(axis=1)
    next_start = np.append(start_min[1:], end_max[-1])
    span = next_start - start_min
    rows: dict[str, PhaseRow] = {}
    for s, name in enumerate(names):
        row = rows.setdefault(name, PhaseRow(name, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
        row.count += 1
        row.total_us += span[s]
        row.critical_us += end_max[s] - start_min[s]
        row.busy_us += float(np.mean(t[s, :, 1] - t[s, :, 0]))
        row.spread_us += end_max[s] - end_min[s]
        row.barrier_us += next_start[s] - end_max[s]
    for row in rows.values():
        row.span_us = row.total_us / row.count
        for attr in ("critical_us", "busy_us", "spread_us", "barrier_us"):
            setattr(row, attr, getattr(row, attr) / row.count)
    if gemv is not None:
        _split_gemv(rows, t, gemv.astype(np.float64) / 1e3, names)
    return list(rows.values())


def _split_gemv(rows: dict[str, PhaseRow], t: np.ndarray, g: np.ndarray, names: list[str]) -> None:
    """Prologue, stream and epilogue means of every kind whose blocks ran a GEMV (stream start stamped)."""
    for name, row in rows.items():
        idx = [s for s, n in enumerate(names) if n == name]
        ran = g[idx, :, 0] > 0
        if not ran.any():
            continue
        ts, tg = t[idx], g[idx]
        row.prologue_us = float((tg[..., 0] - ts[..., 0])[ran].mean())
        row.stream_us = float((tg[..., 1] - tg[..., 0])[ran].mean())
        row.epilogue_us = float((ts[..., 1] - tg[..., 1])[ran].mean())


def format_breakdown(rows: list[PhaseRow], ms_per_token: float | None = None) -> str:
    total = sum(r.total_us for r in rows)
    head = f"   per-phase breakdown of one step (globaltimer stamps): phases sum to {total / 1e3:.3f} ms"
    if ms_per_token:
        head += f" of {ms_per_token:.3f} ms/token measured (timing build)"
    split = any(r.stream_us is not None for r in rows)
    lines = [
        head,
        f"   {'phase':10s} {'n':>4s} {'total ms':>9s} {'share':>6s} {'span us':>8s} {'crit us':>8s} "
        f"{'busy us':>8s} {'spread':>7s} {'barrier':>8s}"
        + (f" {'prolog':>7s} {'stream':>7s} {'epilog':>7s}" if split else ""),
    ]
    for r in rows:
        line = (
            f"   {r.name:10s} {r.count:4d} {r.total_us / 1e3:9.3f} {100 * r.total_us / max(total, 1e-9):5.1f}% "
            f"{r.span_us:8.2f} {r.critical_us:8.2f} {r.busy_us:8.2f} {r.spread_us:7.2f} {r.barrier_us:8.2f}"
        )
        if r.stream_us is not None:
            line += f" {r.prologue_us:7.2f} {r.stream_us:7.2f} {r.epilogue_us:7.2f}"
        lines.append(line)
    return "\n".join(lines)


# ---- per item: the phases where few blocks work ------------------------------------------------------
def attention_items(
    config: ModelConfig,
    tokens: int,
    context: int,
    grid: int,
    att_pairs: int,
    chunk: int,
    split_log: int | None = None,
) -> list[str]:
    """A label per attention work item, in item order (block b runs item b while items fit the grid): the plan's
    `att_split` (phases.cuh mirrors it) at `context` positions before a launch of `tokens`."""
    tuning = (
        Tuning(att_chunk=chunk) if split_log is None else Tuning(att_chunk=chunk, att_split_log=split_log)
    )
    sp = att_split(config, tokens, context + tokens, grid, tuning, att_pairs)
    chunks = -(-(context + tokens) // chunk)
    pairs = config.num_attention_heads // config.num_key_value_heads * tokens
    labels = []
    for head in range(config.num_key_value_heads):
        for s in range(sp.splits):
            c0, c1 = s << sp.log, min(chunks, (s + 1) << sp.log) - 1
            where = f"c{c0}" if c0 == c1 else f"c{c0}-{c1}"
            for p in range(sp.passes):
                first, last = p * sp.pairs, min(pairs, (p + 1) * sp.pairs) - 1
                # Pair pp is query head pp // tokens of this key/value head, token pp % tokens.
                who = ",".join(f"q{pp // tokens}t{pp % tokens}" for pp in range(first, last + 1))
                labels.append(f"kv{head} {where} {who}")
    return labels


def deltanet_items(config: ModelConfig, split: int) -> list[str]:
    """A label per DeltaNet recurrence item (value head, column slice), in item order (phases.cuh)."""
    return [f"hv{i // split} slice{i % split}" for i in range(config.linear_num_value_heads * split)]


@dataclass
class ItemTimes:
    label: str
    start_us: float  # mean over instances: when the block left the barrier, after the phase's first block
    busy_us: float  # mean: end - start
    end_us: float  # mean: end, after the phase's first start


def item_times(stamps: list[np.ndarray], names: list[str], kind: str, labels: list[str]) -> list[ItemTimes]:
    """Mean start, busy and end per block of every phase of `kind` over launches (stamps: one [steps, blocks, 2]
    array in ns per launch); blocks past `labels` (no item) are pooled into one row labelled "idle"."""
    idx = [s for s, n in enumerate(names) if n == kind]
    if not idx:
        raise ValueError(f"no phase {kind!r} in the step")
    t = np.stack([s[idx] for s in stamps]).astype(np.float64) / 1e3  # [launches, instances, blocks, 2]
    if len(labels) > t.shape[2]:
        raise ValueError(
            f"{len(labels)} items on {t.shape[2]} blocks: blocks run several, so a block is not an item"
        )
    first = t[..., 0].min(axis=2, keepdims=True)
    start = (t[..., 0] - first).reshape(-1, t.shape[2]).mean(axis=0)
    busy = (t[..., 1] - t[..., 0]).reshape(-1, t.shape[2]).mean(axis=0)
    end = (t[..., 1] - first).reshape(-1, t.shape[2]).mean(axis=0)
    n = min(len(labels), t.shape[2])
    rows = [ItemTimes(labels[b], float(start[b]), float(busy[b]), float(end[b])) for b in range(n)]
    if n < t.shape[2]:
        rows.append(ItemTimes("idle", float(start[n:].mean()), float(busy[n:].mean()), float(end[n:].mean())))
    return rows


def format_item_times(rows: list[ItemTimes], kind: str, slowest: int = 12) -> str:
    """The items that end last, and the spread of starts and busy times over the items."""
    items = [r for r in rows if r.label != "idle"]
    starts = np.array([r.start_us for r in items])
    busies = np.array([r.busy_us for r in items])
    lines = [
        f"   {kind}: {len(items)} items; start after the first block: median {np.median(starts):.2f} us, max "
        f"{starts.max():.2f}; busy: median {np.median(busies):.2f} us, max {busies.max():.2f}",
        f"   {'item':28s} {'start us':>9s} {'busy us':>8s} {'end us':>8s}",
    ]
    for r in sorted(rows, key=lambda r: -r.end_us)[:slowest]:
        lines.append(f"   {r.label:28s} {r.start_us:9.2f} {r.busy_us:8.2f} {r.end_us:8.2f}")
    return "\n".join(lines)

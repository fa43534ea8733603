"""Is a block's speed in a GEMV phase a property of its SM? Per-block busy times over many launches of a timing build.

run (GPU machine, from the link tree of check_kernels.sh):
    python3 tools/gpu/block_balance.py LAYERS scalar|mma T LAUNCHES [OUT_DIR]
Every weight-streaming phase gives each block the same bytes (to a row), yet the slowest block ends several
microseconds after the first (over a millisecond of finishing spread per step). If the same SMs are slow in
every launch, shares weighted by SM would recover most of it; if the slow blocks change from launch to launch,
only run-time balancing can. This prints, per phase kind: the spread, how much of a block's relative speed the
other half of the launches predicts (split-half correlation, by block and by SM), and the critical path that
shares weighted by the first half's speeds would leave in the second half. Raw busy times go to OUT_DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onestream.kernels.phase_timing import step_phases
from timing_launches import timed_launches  # this folder (the script's directory is on sys.path)

GEMV_KINDS = ("dn_in", "dn_out", "att_in", "att_out", "mlp_in", "mlp_down", "lm_head")


def split_half(rel: np.ndarray) -> float:
    """Correlation of the per-unit mean relative time between even and odd launches; rel [launches, units]."""
    a, b = rel[0::2].mean(axis=0), rel[1::2].mean(axis=0)
    return float(np.corrcoef(a, b)[0, 1])


def relative_by_launch(sel: np.ndarray) -> np.ndarray:
    """A unit's mean busy time relative to the mean of its phase, per launch: [launches, units] from
    sel [launches, instances, units]."""
    return (sel / sel.mean(axis=2, keepdims=True)).mean(axis=1)


def weighted_critical(busy: np.ndarray, speed: np.ndarray) -> tuple[float, float, float]:
    """(actual critical, critical with shares proportional to 1 / speed, mean busy), per instance in us, from busy
    [instances, units] and the predicted relative time per unit of the same bytes `speed` [units]."""
    share = (1.0 / speed) / (1.0 / speed).mean()  # bytes of each unit relative to the even split
    return float(busy.max(axis=1).mean()), float((busy * share).max(axis=1).mean()), float(busy.mean())


def main() -> None:
    layers, gemv, tokens, launches = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    out = Path(sys.argv[5]) if len(sys.argv) > 5 else None
    run = timed_launches(layers, gemv, tokens, launches)
    names = step_phases(run.config)
    stamps = np.stack(run.stamps).astype(np.float64) / 1e3  # [launches, steps, blocks, (start, end)] us
    busy_a = stamps[..., 1] - stamps[..., 0]  # [launches, steps, blocks]
    sm_a = np.stack(run.sms)  # [launches, blocks]
    grid = busy_a.shape[2]
    stable = bool((sm_a == sm_a[0]).all())
    print(
        f"{launches} launches, T={tokens}, {gemv} GEMV, {layers} layers, grid {grid}; block->SM mapping "
        f"{'the same in every launch' if stable else 'changes between launches'}; SM ids {sm_a.min()}..{sm_a.max()}"
    )
    # Per SM: reorder each launch's blocks by the SM they ran on.
    order = np.argsort(sm_a, axis=1)
    by_sm = np.take_along_axis(busy_a, order[:, None, :], axis=2)
    print(
        f"{'kind':9s} {'n':>3s} {'busy us':>8s} {'spread':>7s} {'r block':>8s} {'r SM':>6s} "
        f"{'crit us':>8s} {'weighted':>8s} {'per step':>9s}"
    )
    total_gain = 0.0
    for kind in GEMV_KINDS:
        idx = [s for s, n in enumerate(names) if n == kind]
        if not idx:
            continue
        block_sel, sm_sel = busy_a[:, idx, :], by_sm[:, idx, :]  # [launches, instances, units]
        r_block = split_half(relative_by_launch(block_sel))
        sm_rel = relative_by_launch(sm_sel)
        r_sm = split_half(sm_rel)
        # Shares from the even launches' speeds, applied to the odd launches.
        odd = sm_sel[1::2].reshape(-1, sm_sel.shape[2])
        crit, weighted, mean_busy = weighted_critical(odd, sm_rel[0::2].mean(axis=0))
        spread = float((sm_sel.max(axis=2) - sm_sel.min(axis=2)).mean())
        gain = (crit - weighted) * len(idx)
        total_gain += gain
        print(
            f"{kind:9s} {len(idx):3d} {mean_busy:8.2f} {spread:7.2f} {r_block:8.3f} {r_sm:6.3f} "
            f"{crit:8.2f} {weighted:8.2f} {gain:7.1f}us"
        )
    print(
        f"critical path the SM-weighted shares would save per step (GEMV phases, odd launches): {total_gain:.0f} us"
    )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            out / f"block_balance_{gemv}_t{tokens}.npz",
            busy_us=busy_a.astype(np.float32),
            sms=sm_a.astype(np.int16),
            names=np.array(names),
        )


if __name__ == "__main__":
    main()

"""Which work items of the attention and DeltaNet recurrence phases end last, and do they start late or run long?

run (GPU machine, from the link tree of check_kernels.sh):
    PYTHONPATH=/tmp/onestream-pkg python3 tools/gpu/mixer_items.py LAYERS scalar|mma T LAUNCHES
Block b runs item b, so a timing build's per-block stamps give each item's start (after the phase's first block),
busy time and end, averaged over the phase's layers and LAUNCHES launches; blocks without an item are one "idle" row.
It tells a slow phase whose items run long from one whose items start late (or whose benchmark ran at a
longer context).
"""

from __future__ import annotations

import sys

from onestream.kernels.phase_timing import (
    attention_items,
    deltanet_items,
    format_item_times,
    item_times,
    step_phases,
)
from onestream.kernels.plan import KernelPlan
from timing_launches import CONTEXT, timed_launches  # this folder (the script's directory is on sys.path)


def main() -> None:
    layers, gemv, tokens, launches = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    run = timed_launches(layers, gemv, tokens, launches)
    config, runner = run.config, run.runner
    names = step_phases(config)
    spec = runner.describe(tokens)
    att_pairs = KernelPlan(config, runner.grid, tokens, runner.tuning).att_pairs  # per item at most
    print(f"T={tokens}, {gemv} GEMV, {layers} layers, context {CONTEXT}, {launches} launches; build {spec}")
    labels = attention_items(config, tokens, CONTEXT, runner.grid, att_pairs, runner.tuning.att_chunk)
    print(format_item_times(item_times(run.stamps, names, "attention", labels), "attention"))
    dn = deltanet_items(config, spec["dn_split"])
    print(format_item_times(item_times(run.stamps, names, "dn_rec", dn), "dn_rec"))


if __name__ == "__main__":
    main()

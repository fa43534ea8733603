"""One training step under torch.profiler: where the time goes, written as a table next to the training log.

Kernel launches are counted from the device events (CUDA) or, on a CPU, from the aten operators that do work
(leaves of the operator tree, view-only operators left out): the per-step launch count is what makes small
models launch-bound.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# aten operators that only make views or metadata: no kernel behind them
VIEW_OPS = frozenset(
    [
        "alias",
        "as_strided",
        "chunk",
        "detach",
        "diagonal",
        "empty",
        "empty_like",
        "empty_strided",
        "expand",
        "expand_as",
        "flatten",
        "movedim",
        "narrow",
        "permute",
        "reshape",
        "_reshape_alias",
        "resolve_conj",
        "resolve_neg",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unsqueeze",
        "view",
        "view_as",
        "_unsafe_view",
        "lift_fresh",
        "result_type",
    ]
)
ROWS = 30


def start(on_cuda: bool) -> profile:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def finish(profiler: profile, path: Path, on_cuda: bool) -> dict:
    """Stop, write the table to `path`, return {"launches": ..., "device_ms": ...} for the results."""
    if on_cuda:
        torch.cuda.synchronize()
    profiler.stop()
    events = profiler.events()
    if on_cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = len(kernels)
        device_ms = sum(e.device_time_total for e in kernels) / 1000
        sort_by = "self_device_time_total"
    else:
        launches = sum(
            1
            for e in events
            if e.name.startswith("aten::")
            and e.name[6:] not in VIEW_OPS
            and not any(child.name.startswith("aten::") for child in e.cpu_children)
        )
        device_ms = sum(e.self_cpu_time_total for e in events) / 1000
        sort_by = "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort_by, row_limit=ROWS)
    path.write_text(f"kernel launches: {launches}, device time {device_ms:.1f} ms\n{table}\n")
    return {"launches": launches, "device_ms": device_ms}

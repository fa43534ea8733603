"""tools/host_launch_costs.py: the host time of a launch's plan and cache bookkeeping, on the CPU."""

from __future__ import annotations

import re
from pathlib import Path

from deploy_scripts import load_module

TOOL = Path(__file__).resolve().parent.parent / "tools" / "host_launch_costs.py"


def test_it_times_the_plans_layout_and_a_caches_reserve(capsys) -> None:  # type: ignore[no-untyped-def]
    assert load_module(TOOL).main(["--tokens", "1", "--number", "200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r": [0-9.]+ us$", "", line) for line in lines] == [
        "KernelPlan.smem_bytes, T = 1",
        "KVCache.reserve within its capacity, auto cache",
        "KVCache.reserve within its capacity, int8 cache",
    ]

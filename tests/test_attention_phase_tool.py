"""tools/gpu/attention_phase.py's byte count and marginal rate (the GPU part runs on the GPU machine only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_scripts import load_module
from onestream.kernels.random_model import config_27b

TOOL = Path(__file__).resolve().parent.parent / "tools" / "gpu" / "attention_phase.py"


def test_the_bytes_are_the_layers_keys_and_values_and_the_marginal_rate_leaves_the_fixed_cost_out() -> None:
    tool = load_module(TOOL)
    c = config_27b(4)
    assert tool.kv_bytes(c, 131072) == 4 * 131072 * 256 * 2 * 2  # 537 MB: 4 kv heads of 256 dims, K and V
    assert tool.kv_bytes(c, 131072, "int8") == 4 * 131072 * (256 + 4) * 2  # levels and a scale per vector
    rows = [
        {"context": 512, "us": 20.0, "bytes": tool.kv_bytes(c, 512)},
        {"context": 131072, "us": 520.0, "bytes": tool.kv_bytes(c, 131072)},
        {"context": 32768, "us": 145.0, "bytes": tool.kv_bytes(c, 32768)},
    ]
    extra = tool.kv_bytes(c, 131072) - tool.kv_bytes(c, 32768)
    assert tool.marginal_gbs(rows) == pytest.approx(extra / 375e-6 / 1e9)
    assert tool.marginal_gbs(rows[:1]) is None


def test_builds_are_labelled_tuning_changes_over_a_cache_format() -> None:
    args = load_module(TOOL).parse_args(["--tuning", "t640:threads=640", "--context", "512,4096"])
    assert args.tuning == [("t640", {"threads": 640})] and args.kv_cache == "auto"
    assert load_module(TOOL).parse_args(["--kv-cache", "int8"]).kv_cache == "int8"
    with pytest.raises(SystemExit):
        load_module(TOOL).parse_args(["--kv-cache", "fp8"])
    with pytest.raises(SystemExit):
        load_module(TOOL).parse_args(["--tuning", "threads=640"])

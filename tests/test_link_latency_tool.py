"""tools/link_latency.py: the card link's first and later item times, on new and kept connections."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from deploy_scripts import load_module

TOOL = Path(__file__).resolve().parent.parent / "tools" / "link_latency.py"


def test_both_modes_report_positive_medians(capsys: pytest.CaptureFixture) -> None:
    assert load_module(TOOL).main(["--calls", "6", "--items", "3", "--gap-ms", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(
        r"^(new connection per call|kept connection) +first item ([\d.]+) ms, each later item ([\d.]+) ms",
        out,
        re.M,
    )
    assert [r[0] for r in rows] == ["new connection per call", "kept connection"]
    assert all(float(first) > 0 and float(later) > 0 for _, first, later in rows)

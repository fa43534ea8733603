"""tools/frontdoor_latency.py on a real CPU pool: both paths are timed, hop by hop, and the difference printed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from deploy_scripts import load_module

TOOL = Path(__file__).resolve().parent.parent / "tools" / "frontdoor_latency.py"

pytestmark = pytest.mark.slow


def test_both_paths_report_their_way_in_and_out(capsys: pytest.CaptureFixture) -> None:
    assert load_module(TOOL).main(["--requests", "2", "--prompt-tokens", "8", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(
        r"^(gRPC|HTTP): first chunk ([\d.]+) \(in: client -> router's handler ([\d.]+); out: router's first item -> client ([\d.]+)\)",
        out,
        re.M,
    )
    assert [r[0] for r in rows] == ["gRPC", "HTTP"]
    for _, first, way_in, way_out in rows:
        assert 0 < float(way_in) + float(way_out) < float(first)
    assert re.search(r"^the front door adds [+-][\d.]+ to the first chunk", out, re.M)
    from onestream.cluster import router

    assert router.Router.Generate.__qualname__ == "Router.Generate"  # the tool put the router's own back

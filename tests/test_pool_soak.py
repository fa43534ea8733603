"""The soak in CI, small: 2 CPU cards on 2 Ray nodes, 4 sessions of 4 turns with random cancels and
Aborts, one card actor killed, a node added and another removed, the router restarted (cluster/soak.py
lists the checks). `onestream soak` runs the same with larger numbers."""

from __future__ import annotations

import pytest
from onestream.cluster.soak import SoakSettings, run_soak

pytestmark = pytest.mark.slow


def test_the_pool_survives_a_soak_with_faults() -> None:
    report = run_soak(SoakSettings(cards=2, sessions=4, turns=4))
    print(report.summary())
    assert report.faults == ["killed a card actor", "added a node, removed another", "restarted the router"]
    assert not report.problems, "\n".join(report.problems)
    assert report.memory_mb, "at least one card lived through the whole soak"

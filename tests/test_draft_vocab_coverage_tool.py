"""tools/draft_vocab_coverage.py: the share of a text's tokens among the first ids, and the learnt prefix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from deploy_scripts import load_module

TOOL = Path(__file__).resolve().parent.parent / "tools" / "draft_vocab_coverage.py"


def test_the_shares_grow_with_the_prefix_and_the_learnt_prefix_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    source = tmp_path / "code.py"
    source.write_text(Path(__file__).read_text() * 40)
    assert load_module(TOOL).main([str(source), "--prefix", "256", "1024", "4096"]) == 0
    out = capsys.readouterr().out
    shares = [float(s) for s in re.findall(r"the first \d+ ids hold ([\d.]+) %", out)]
    assert len(shares) == 3 and shares == sorted(shares) and 0 < shares[0] < 100
    assert "need ids below" in out and "DraftVocabulary learns:" in out

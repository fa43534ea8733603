"""tools/kv_cache_kld.py: its roundings, and a short run on the embedded model (CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deploy_scripts import load_module

TOOL = Path(__file__).resolve().parent.parent / "tools" / "kv_cache_kld.py"


@pytest.fixture(scope="module")
def tool():
    return load_module(TOOL)


def test_roundings_keep_each_vector_within_its_formats_step(tool) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, 256, generator=g) * torch.logspace(-2, 2, 16)[None, :, None]
    top = x.abs().amax(-1, keepdim=True)
    int8 = tool.integers(x, 8)
    assert torch.all((int8 - x).abs() <= top / 127 / 2 * (1 + 1e-6))
    int4 = tool.integers(x, 4, 32)
    groups = x.reshape(4, 16, 8, 32).abs().amax(-1, keepdim=True)
    assert torch.all((int4 - x).reshape(4, 16, 8, 32).abs() <= groups / 7 / 2 * (1 + 1e-6))
    scaled = tool.fp8(x, torch.float8_e4m3fn, scaled=True)
    assert torch.all((scaled - x).abs() <= x.abs() / 16 + top / 448 * 2**-9)  # 3 mantissa bits
    assert torch.equal(
        tool.fp8(torch.tensor([1e4, -1e4]), torch.float8_e4m3fn, scaled=False), torch.tensor([448.0, -448.0])
    )


def test_a_short_run_prints_every_cache_against_fp32(
    tool, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str(10 + i % 200) for i in range(96)))
    assert tool.main(["--tokens", str(tokens), "--limit", "96", "--ctx", "48"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "KLD" not in line]
    assert [r.split(" | ")[0][2:] for r in rows] == list(tool.ROUNDINGS)
    kld = {r.split(" | ")[0][2:]: float(r.split(" | ")[1]) for r in rows}
    assert 0.0 <= kld["bf16 (today's cache)"] < kld["int4, a scale per 32 values"]

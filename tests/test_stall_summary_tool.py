"""tools/stall_summary.py on a small source page in Nsight Compute's CSV form (no GPU or ncu needed)."""

from __future__ import annotations

import gzip
from pathlib import Path

from deploy_scripts import load_module

TOOL = Path(__file__).resolve().parent.parent / "tools" / "stall_summary.py"

HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"Instructions Executed","stall_long_sb","stall_wait","stall_barrier","stall_long_sb (Not Issued)"'
)


def _row(
    address: int, source: str, samples: int, executed: int, long_sb: int, wait: int, barrier: int
) -> str:
    return f'"{address:#x}","{source}","{samples}","{samples}","{executed:,}","{long_sb}","{wait}","{barrier}","0"'


def _page(path: Path) -> Path:
    rows = [
        _row(0x100, "LDC R1, c[0x0][0x28]", 0, 10, 0, 0, 0),
        _row(0x110, "LDGDEPBAR", 2, 1000, 0, 2, 0),
        _row(0x120, "BRA.DIV UR4, 0x200", 90, 1000, 88, 2, 0),
        _row(0x130, "@P0 IDP.4A.S8.S8 R1, R2, R3, RZ", 6, 4000, 0, 6, 0),
        _row(0x140, "BAR.SYNC.DEFER_BLOCKING 0x0", 0, 50, 0, 0, 0),
        _row(0x150, "UMOV UR4, 0x400", 30, 50, 0, 0, 30),
    ]
    text = '"Kernel Name","mk_decode",\n' + "\n".join([HEADER, *rows]) + "\n"
    path.write_bytes(gzip.compress(text.encode()))
    return path


def test_the_summary_names_the_reasons_opcodes_and_hot_instructions(tmp_path: Path) -> None:
    tool = load_module(TOOL)
    instrs = tool.read_source_page(_page(tmp_path / "stalls.csv.gz"))
    assert [i.opcode for i in instrs] == ["LDC", "LDGDEPBAR", "BRA", "IDP", "BAR", "UMOV"]
    assert instrs[3].executed == 4000 and instrs[2].reasons == {"long_sb": 88, "wait": 2}
    text = tool.summarise(instrs, top=2, window=2)
    lines = text.splitlines()
    assert lines[0] == "6 instructions, 128 samples"
    assert lines[1].startswith("by reason: long_sb 69%, barrier 23%, wait 8%")
    top = lines[lines.index("top 2 instructions:") + 1]
    assert "BRA.DIV" in top and "70.31%" in top and "long_sb 98%" in top
    # The two hottest stretches of 2 instructions, which do not overlap: the ring wait and its loop, then the barrier.
    assert tool.hottest_stretches(instrs, 2, 8)[:2] == [(2, 3, 96), (4, 5, 30)]


def test_a_page_without_samples_says_so(tmp_path: Path) -> None:
    tool = load_module(TOOL)
    path = tmp_path / "empty.csv"
    path.write_text('"Kernel Name","k",\n' + HEADER + "\n" + _row(0x100, "NOP", 0, 1, 0, 0, 0) + "\n")
    assert tool.summarise(tool.read_source_page(path), top=5, window=4) == "no stall samples in the file"

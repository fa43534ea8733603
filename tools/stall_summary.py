"""Where a kernel's warps wait, from Nsight Compute's source page (tools/gpu/stall_profile.sh's stalls.csv.gz).

    python tools/stall_summary.py STALLS.csv[.gz] [--top 40] [--window 64]

Prints the stall samples by reason for the whole launch, by opcode, the instructions with the most samples (each
with its reasons), and the hottest stretches of `--window` consecutive instructions: a loop's body shows as one
stretch, so its share of the samples is the share of the launch's warp time spent in it.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Instr:
    index: int
    address: str
    source: str
    samples: int
    executed: int
    reasons: dict[str, int]

    @property
    def opcode(self) -> str:
        words = self.source.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0].split(".")[0] if words else "?"


def _number(text: str) -> int:
    text = text.replace(",", "").strip()
    return int(float(text)) if text and text not in ("-", "no data") else 0


def read_source_page(path: Path) -> list[Instr]:
    """The instructions of the source page's CSV, in address order (the first line names the kernel)."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    lines = raw.decode().splitlines()
    header_at = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    rows = csv.DictReader(io.StringIO("\n".join(lines[header_at:])))
    instrs = []
    for i, row in enumerate(rows):
        reasons = {
            key[len("stall_") :]: _number(value)
            for key, value in row.items()
            if key and key.startswith("stall_") and "(Not Issued)" not in key
        }
        instrs.append(
            Instr(
                i,
                row["Address"],
                row["Source"].strip(),
                _number(row["Warp Stall Sampling (All Samples)"]),
                _number(row["Instructions Executed"]),
                {k: v for k, v in reasons.items() if v},
            )
        )
    return instrs


def _reasons_text(reasons: dict[str, int], total: int, top: int = 4) -> str:
    if total <= 0:
        return ""
    ranked = sorted(reasons.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in ranked)


def hottest_stretches(instrs: list[Instr], window: int, count: int) -> list[tuple[int, int, int]]:
    """Up to `count` non-overlapping stretches of `window` instructions with the most samples: (first, last, samples)."""
    prefix = [0]
    for ins in instrs:
        prefix.append(prefix[-1] + ins.samples)
    spans = sorted(
        ((prefix[i + window] - prefix[i], i) for i in range(max(0, len(instrs) - window + 1))), reverse=True
    )
    taken: list[tuple[int, int, int]] = []
    for samples, i in spans:
        if samples <= 0 or len(taken) >= count:
            break
        if all(i + window <= a or i >= b + 1 for a, b, _ in taken):
            taken.append((i, i + window - 1, samples))
    return taken


def summarise(instrs: list[Instr], top: int, window: int) -> str:
    total = sum(ins.samples for ins in instrs)
    if total == 0:
        return "no stall samples in the file"
    by_reason: Counter[str] = Counter()
    by_opcode: Counter[str] = Counter()
    executed_by_opcode: Counter[str] = Counter()
    for ins in instrs:
        by_reason.update(ins.reasons)
        by_opcode[ins.opcode] += ins.samples
        executed_by_opcode[ins.opcode] += ins.executed
    out = [f"{len(instrs)} instructions, {total} samples"]
    out.append("by reason: " + _reasons_text(dict(by_reason), total, top=12))
    out.append("by opcode (samples, warp instructions executed):")
    for op, n in by_opcode.most_common(16):
        out.append(f"   {op:10s} {100 * n / total:5.1f}%  {executed_by_opcode[op]:>12,d}")
    out.append(f"top {top} instructions:")
    for ins in sorted(instrs, key=lambda x: -x.samples)[:top]:
        out.append(
            f"   #{ins.index:<6d} {100 * ins.samples / total:5.2f}%  exec {ins.executed:>10,d}  {ins.source[:60]:60s}"
            f"  {_reasons_text(ins.reasons, ins.samples)}"
        )
    out.append(f"hottest stretches of {window} instructions:")
    for first, last, samples in hottest_stretches(instrs, window, 8):
        reasons: Counter[str] = Counter()
        for ins in instrs[first : last + 1]:
            reasons.update(ins.reasons)
        out.append(
            f"   #{first}-#{last}: {100 * samples / total:5.1f}%  ({_reasons_text(dict(reasons), samples, top=5)})"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--window", type=int, default=64)
    args = parser.parse_args()
    print(summarise(read_source_page(args.path), args.top, args.window))


if __name__ == "__main__":
    main()

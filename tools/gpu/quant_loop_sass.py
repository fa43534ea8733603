"""Instructions per item of the quantized GEMV's loop, read from the SASS of the 27B builds, without a GPU.

    python tools/gpu/quant_loop_sass.py [--base REF] [--formats q4_k q6_k] [--tokens 1 4] [--arch sm_90]

For each weight format a build whose every GEMV (and the embedding) is in that format, so that the megakernel has
one quantized item loop: its instructions per item (the innermost loop around the dp4a multiplies), how many of
them are the multiplies, the copies into the weight ring and the shared-memory loads, and the instructions per
row-unit (one lane's 32 weights of one row). The loop is instruction-issue bound on the H200 (docs/benchmarks.md,
issue 21), so fewer instructions per row-unit is what a change to it must show before the GPU times it. With
`--base`, the same for another tree (a folder or a git ref), side by side. Needs nvcc, ptxas and cuobjdump (PATH or
pip nvidia-cuda-cuobjdump), as tools/gpu/compare_builds.py does, whose helpers this uses.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import re
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("compare_builds", HERE / "compare_builds.py")
assert _spec is not None and _spec.loader is not None
cb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cb)

# Run inside each tree's package: writes <format>-T<t>.cu for every build into argv[1].
EMIT = r"""
import json, sys
sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
from pathlib import Path
from onestream.kernels.build import assemble_source
from onestream.kernels.plan import KernelPlan, WeightFormat, weight_formats_of
from onestream.kernels.plan import WEIGHT_KINDS
from onestream.kernels.random_model import config_27b

out, formats, tokens, arch = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
sms, smem = json.loads(sys.argv[5])
for name in formats:
    fmt = WeightFormat(name)
    for t in tokens:
        plan = KernelPlan(config_27b(), num_sms=sms, smem_limit=smem, tokens_per_launch=t,
                          weight_formats=weight_formats_of({k: {fmt} for k in WEIGHT_KINDS}), embed_format=fmt)
        (out / f"{name}-T{t}.cu").write_text(assemble_source(plan))
print("ok")
"""


def emit(tree: Path, work: Path, formats: list[str], tokens: list[int], arch: str) -> Path:
    """The CUDA text of every (format, tokens per launch) build, by that tree's own build code, in work/src."""
    src = work / "src"
    src.mkdir(parents=True)
    args = [str(src), json.dumps(formats), json.dumps(tokens), arch, json.dumps(cb.ARCHS[arch])]
    cb.run_in_tree(tree, work, EMIT, *args)
    return src


_TARGET = re.compile(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)")


def raw_sass(source: Path, arch: str, cache: Path) -> str:
    """SASS with its addresses (the loop's branch targets are addresses): ptxas of nvcc's PTX, then cuobjdump."""
    ptx = cb.nvcc_ptx(source, arch, cache)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "mk.cubin"
        subprocess.run(
            ["ptxas", f"-arch={arch}", str(ptx), "-o", str(cubin)], check=True, capture_output=True
        )
        return subprocess.run(
            [cb.tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout


def item_loop(sass: str) -> list[str] | None:
    """The innermost loop of mk_decode around dp4a multiplies (the item loop), as its instructions."""
    lines = cb.functions(sass, cb.SASS_FUNCTION).get("mk_decode", [])
    ins = []
    for line in lines:
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    at = {a: i for i, (a, _) in enumerate(ins)}
    best: list[str] | None = None
    for i, (a, op) in enumerate(ins):
        m = _TARGET.search(op)
        if not m or int(m.group(1), 16) > a or int(m.group(1), 16) not in at:
            continue
        body = [o for _, o in ins[at[int(m.group(1), 16)] : i + 1]]
        if any("IDP.4A" in o for o in body) and (best is None or len(body) < len(best)):
            best = body
    return best


def summarize(body: list[str], rows_units: int) -> dict[str, float]:
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", o).split()[0] for o in body)
    return {
        "instructions": len(body),
        "dp4a": sum(v for k, v in ops.items() if k.startswith("IDP.4A")),
        "ring copies": sum(v for k, v in ops.items() if k.startswith("LDGSTS")),
        # ptxas puts never-executed loads (@!PT LDS RZ, [RZ]) before ring copies: not the loop's loads
        "shared loads": sum(o.split()[0].startswith("LDS") for o in body if not o.startswith("@!PT")),
        "per row-unit": len(body) / rows_units,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base", default=None, help="another tree to count beside this checkout (folder or git ref)"
    )
    ap.add_argument("--formats", nargs="+", default=["q4_k", "q6_k"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    ap.add_argument("--arch", choices=sorted(cb.ARCHS), default="sm_90")
    args = ap.parse_args(argv)
    trees = {"this": cb.REPO}
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir()
        if args.base:
            trees = {"base": cb.export_tree(args.base, Path(tmp) / "base-tree"), **trees}
        for label, tree in trees.items():
            src = emit(tree, Path(tmp) / label, args.formats, args.tokens, args.arch)
            for cu in sorted(src.glob("*.cu")):
                body = item_loop(raw_sass(cu, args.arch, cache))
                # One item: rows per item x one unit per lane (the plan's quant_rows, read from the defines).
                rows = int(re.search(r"#define MK_QROWS (\d+)", cu.read_text()).group(1))  # type: ignore[union-attr]
                results.setdefault(cu.stem, {})[label] = summarize(body, rows) if body else {}
    for build, by_tree in results.items():
        print(f"{build}:")
        for label, s in by_tree.items():
            if not s:
                print(f"  {label}: no dp4a item loop found")
                continue
            print(
                f"  {label}: {s['instructions']:.0f} instructions per item ({s['per row-unit']:.1f} per row-unit), "
                f"dp4a {s['dp4a']:.0f}, ring copies {s['ring copies']:.0f}, shared loads {s['shared loads']:.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

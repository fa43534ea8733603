"""Spills per function of the 27B bf16 megakernel builds at chosen tokens per launch, without a GPU.

    python tools/gpu/build_spills.py [--tokens 8 16] [--gemv scalar tensor] [--arch sm_90]

Each build's CUDA text comes from this tree's own build code (kernels/build.py, as tools/gpu/compare_builds.py
does); `nvcc -Xptxas -v` compiles it, and every function with a stack frame or spills is printed: the check a
wider launch must pass before it is worth timing on the GPU. Needs nvcc.
"""

from __future__ import annotations

import argparse
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

EMIT = r"""
import json, sys
sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
from pathlib import Path
from onestream.kernels.build import assemble_source
from onestream.kernels.plan import KernelPlan
from onestream.kernels.random_model import config_27b
from onestream.kernels.tuning import Tuning

out, tokens, gemvs = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
sms, smem = json.loads(sys.argv[4])
for t in tokens:
    for gemv in gemvs:
        plan = KernelPlan(config_27b(), num_sms=sms, smem_limit=smem, tokens_per_launch=t,
                          tuning=Tuning(mma=gemv == "tensor"))
        (out / f"bf16-{gemv}-T{t}.cu").write_text(assemble_source(plan))
"""
_FUNCTION = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def spills(source: Path, arch: str, work: Path) -> list[tuple[str, int, int, int]]:
    """(function, stack frame, spill stores, spill loads) of every function with any, from ptxas -v."""
    proc = subprocess.run(
        ["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(work / "x.cubin"), str(source)],
        capture_output=True,
        text=True,
        check=True,
    )
    found, function = [], "?"
    for line in proc.stderr.splitlines():
        if m := _FUNCTION.search(line):
            function = m.group(1)
        elif (m := _FRAME.search(line)) and any(int(x) for x in m.groups()):
            found.append((function, *(int(x) for x in m.groups())))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--gemv", nargs="+", choices=["scalar", "tensor"], default=["tensor"])
    ap.add_argument("--arch", choices=sorted(cb.ARCHS), default="sm_90")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work, src = Path(tmp), Path(tmp) / "src"
        src.mkdir()
        cb.run_in_tree(
            cb.REPO,
            work,
            EMIT,
            str(src),
            json.dumps(args.tokens),
            json.dumps(args.gemv),
            json.dumps(cb.ARCHS[args.arch]),
        )
        for cu in sorted(src.glob("*.cu")):
            print(f"{cu.stem}:")
            for function, frame, stores, loads in spills(cu, args.arch, work):
                print(f"  {function}: stack {frame} B, spill stores {stores} B, loads {loads} B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

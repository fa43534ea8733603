"""Spills per function of the 27B megakernel builds (bf16, or --formats) at chosen tokens per launch, without a GPU.

    python tools/gpu/build_spills.py [--tokens 8 16] [--gemv scalar tensor] [--arch sm_90] [--where [N]]
        [--formats q4_k q6_k] [--kv-cache int8] [--threads 640] [--tuning att_group=8,qunits=2]
        [--loops mk_phase]

Each build's CUDA text comes from this tree's own build code (kernels/build.py, as tools/gpu/compare_builds.py
does); `nvcc -Xptxas -v` compiles it, and every function with a stack frame or spills is printed: the check a
wider launch must pass before it is worth timing on the GPU. ptxas counts a callee's spills once per kernel that
calls it, and a callee may spill in one kernel and not in another (the values its caller keeps across the call
take registers from it). `--where` also says where: the build compiled with line information, nvdisasm's
spill marks counted per kernel and source function, and the N source lines with the most (a spill inside a loop
over positions or weights costs every iteration; one in a prologue costs once). `--loops KERNEL` counts the machine
instructions of KERNEL's loops that do arithmetic (dp4a, an integer mma or at least LOOP_MIN_FFMA FFMAs, fewer
than LOOP_MAX_BODY instructions: the inner loops, not the phases around them), with their most frequent opcodes:
`--loops mk_phase --kv-cache int8 --tokens 1 --gemv scalar` gives the attention loop's instructions per warp step.
Needs nvcc; `--where` and `--loops` also nvdisasm (PATH or the pip package nvidia-cuda-nvdisasm).
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
from typing import NamedTuple

from onestream.commands.bench import tuning_changes

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
from onestream.kernels.plan import WEIGHT_KINDS, KernelPlan, WeightFormat, weight_formats_of
from onestream.kernels.random_model import config_27b
from onestream.kernels.tuning import Tuning

out, tokens, gemvs = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
sms, smem = json.loads(sys.argv[4])
formats, fields, kv = json.loads(sys.argv[5]), json.loads(sys.argv[6]), sys.argv[7]
kinds = weight_formats_of({k: {WeightFormat(f) for f in formats} for k in WEIGHT_KINDS}) if formats else ()
name = "-".join(formats) or "bf16"
for t in tokens:
    for gemv in gemvs:
        tuning = Tuning(mma=gemv == "tensor", **fields)
        plan = KernelPlan(config_27b(), num_sms=sms, smem_limit=smem, tokens_per_launch=t, tuning=tuning,
                          weight_formats=kinds, kv_cache=kv)
        suffix = "".join(f"-{k}={v}" for k, v in sorted(fields.items())) + ("" if kv == "auto" else f"-kv={kv}")
        (out / f"{name}-{gemv}-T{t}{suffix}.cu").write_text(assemble_source(plan))
"""
_FUNCTION = re.compile(r"Function properties for (\S+)")
_ENTRY = re.compile(r"^(\w+):$")  # nvdisasm -c: a kernel's first line
_LINE = re.compile(r'//## File "([^"]*)", line (\d+)')
# A function definition in the generated text: its name is the last identifier before the parameter list.
_DEFINITION = re.compile(r"^(?:template\s*<.*>\s*)?(?:extern \"C\"\s+)?(?:__\w+__\s+)+.*?\b(\w+)\s*\(")
_BRANCH = re.compile(
    r"\bBRA\b.*`\((\.L_x_\d+)\)"
)  # a branch to a label (BRA.DIV: a divergence check, no loop)
_LABEL = re.compile(r"^(\.L_x_\d+):")
_OPCODE = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
# A loop doing arithmetic: dp4a or an integer mma, or at least this many FFMAs (address loops have few).
LOOP_MIN_FFMA = 90
LOOP_MAX_BODY = 1500  # instructions: larger bodies are the phases that hold the loops
_LOCAL_OPCODES = frozenset({"LDL", "STL"})  # local memory: spills, and arrays the registers cannot hold
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


def enclosing_functions(text: str) -> list[str]:
    """The function each line of the generated text (1-based: index 0 unused) lies in, by the last definition
    at or above it."""
    names, current = [""], "?"
    for line in text.splitlines():
        if names[-1] == "__launch_bounds__" and (m := re.match(r"\s*(\w+)\s*\(", line)):
            current = names[-1] = m.group(1)  # a kernel's name follows its __launch_bounds__ line
        elif (m := _DEFINITION.match(line)) and m.group(1) not in ("if", "for", "while", "switch"):
            current = m.group(1)
        names.append(current)
    return names


def spill_sites(
    source: Path, arch: str, work: Path
) -> tuple[collections.Counter[tuple[str, str, int]], bool]:
    """Spill instructions per (kernel, source function, generated line), and whether they are nvdisasm's
    SpillRefill marks. An nvdisasm that writes no marks (the one bundled with triton) gets every local-memory
    instruction counted instead: the spills and the local arrays (a frame's other bytes) together."""
    cubin = work / "lines.cubin"
    subprocess.run(
        ["nvcc", f"-arch={arch}", "-cubin", "-lineinfo", "-o", str(cubin), str(source)], check=True
    )
    sass = subprocess.run(
        [cb.tool("nvdisasm"), "-g", "-c", str(cubin)], capture_output=True, text=True, check=True
    )
    return count_sites(sass.stdout, str(source), enclosing_functions(source.read_text()))


def count_sites(
    sass: str, source: str, functions: list[str]
) -> tuple[collections.Counter[tuple[str, str, int]], bool]:
    """spill_sites' counting over `nvdisasm -g -c` text of a cubin compiled from `source`."""
    marked: collections.Counter[tuple[str, str, int]] = collections.Counter()
    local: collections.Counter[tuple[str, str, int]] = collections.Counter()
    kernel, line = "?", 0
    for text in sass.splitlines():
        if m := _ENTRY.match(text):
            kernel = m.group(1)
        elif m := _LINE.search(text):
            line = int(m.group(2)) if m.group(1) == source else 0
        else:
            site = (kernel, functions[line] if 0 < line < len(functions) else "?", line)
            if '"SpillRefill"' in text:
                marked[site] += 1
            if (m := _OPCODE.search(text)) and m.group(1) in _LOCAL_OPCODES:
                local[site] += 1
    return (marked, True) if marked or not local else (local, False)


class Loop(NamedTuple):
    start: int  # the body's first and last line in the kernel's text
    end: int
    opcodes: collections.Counter[str]

    @property
    def instructions(self) -> int:
        return sum(self.opcodes.values())


def sass_loops(sass: str, kernel: str) -> list[Loop]:
    """The loops of `kernel` in `nvdisasm -c` text that do arithmetic: a label and a later branch back to it (the
    body between them), holding dp4a (IDP), an integer mma (IMMA) or at least LOOP_MIN_FFMA FFMAs, under
    LOOP_MAX_BODY instructions; fewest instructions first."""
    lines, inside = [], False
    for text in sass.splitlines():
        if m := _ENTRY.match(text):
            inside = m.group(1) == kernel
        elif inside:
            lines.append(text)
    labels = {m.group(1): i for i, text in enumerate(lines) if (m := _LABEL.match(text))}
    loops = {}
    for i, text in enumerate(lines):
        m = _BRANCH.search(text)
        if m and "BRA.DIV" not in text and labels.get(m.group(1), i) < i:
            start = labels[m.group(1)]
            ops = collections.Counter(o.group(1) for t in lines[start : i + 1] if (o := _OPCODE.search(t)))
            arithmetic = ops["IDP"] or ops["IMMA"] or ops["FFMA"] >= LOOP_MIN_FFMA
            if arithmetic and sum(ops.values()) < LOOP_MAX_BODY:
                loops[(start, i)] = Loop(start, i, ops)
    return sorted(loops.values(), key=lambda loop: (loop.instructions, loop.start))


def print_loops(cu: Path, arch: str, work: Path, kernel: str) -> None:
    cubin = work / "loops.cubin"
    subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-o", str(cubin), str(cu)], check=True)
    sass = subprocess.run([cb.tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True)
    for loop in sass_loops(sass.stdout, kernel):
        top = ", ".join(f"{op} {n}" for op, n in loop.opcodes.most_common(8))
        local = sum(loop.opcodes[op] for op in _LOCAL_OPCODES)
        print(
            f"  {kernel} loop at SASS lines {loop.start}-{loop.end}: {loop.instructions} instructions, "
            f"{local} local-memory ({top})"
        )


def print_sites(
    sites: collections.Counter[tuple[str, str, int]], marked: bool, source: Path, top: int
) -> None:
    lines = source.read_text().splitlines()
    what = (
        "spill instructions"
        if marked
        else "local-memory instructions (no SpillRefill marks: spills and arrays)"
    )
    per_function: collections.Counter[tuple[str, str]] = collections.Counter()
    for (kernel, function, _), n in sites.items():
        per_function[(kernel, function)] += n
    for kernel in sorted({k for k, _ in per_function}):
        total = sum(n for (k, _), n in per_function.items() if k == kernel)
        print(f"  {kernel}: {total} {what}")
        for (k, function), n in per_function.most_common():
            if k == kernel:
                print(f"    {n:5d}  {function}")
        worst = sorted(((n, line) for (k, _, line), n in sites.items() if k == kernel), reverse=True)[:top]
        for n, line in worst:
            text = lines[line - 1].strip() if 0 < line <= len(lines) else "?"
            print(f"    {n:5d}  line {line}: {text[:100]}")


def build_fields(args: argparse.Namespace) -> dict[str, object]:
    """The Tuning fields of the builds: --tuning's (the syntax of `bench --tuning`), then --threads."""
    return {**args.tuning, **({"threads": args.threads} if args.threads else {})}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--gemv", nargs="+", choices=["scalar", "tensor"], default=["tensor"])
    ap.add_argument("--arch", choices=sorted(cb.ARCHS), default="sm_90")
    ap.add_argument(
        "--formats",
        nargs="*",
        default=[],
        metavar="FORMAT",
        help="quantized weight formats every GEMV kind holds (e.g. q4_k q6_k, the Q4_K_M mix); default bf16",
    )
    ap.add_argument("--kv-cache", choices=["auto", "int8"], default="auto", help="the KV caches' format")
    ap.add_argument("--threads", type=int, default=0, help="threads per block (default: the Tuning's)")
    ap.add_argument(
        "--tuning",
        type=tuning_changes,
        default={},
        metavar="KEY=VALUE,...",
        help="other Tuning fields of the builds (as `bench --tuning`: att_group=8,qunits=2)",
    )
    ap.add_argument(
        "--where",
        type=int,
        nargs="?",
        const=12,
        default=0,
        metavar="N",
        help="also count spill instructions per kernel and source function, and list the N worst lines",
    )
    ap.add_argument(
        "--loops",
        metavar="KERNEL",
        help="also count the instructions of KERNEL's arithmetic loops (mk_phase, mk_decode)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fields = build_fields(args)
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
            json.dumps(args.formats),
            json.dumps(fields),
            args.kv_cache,
        )
        for cu in sorted(src.glob("*.cu")):
            print(f"{cu.stem}:")
            for function, frame, stores, loads in spills(cu, args.arch, work):
                print(f"  {function}: stack {frame} B, spill stores {stores} B, loads {loads} B")
            if args.where:
                print_sites(*spill_sites(cu, args.arch, work), cu, args.where)
            if args.loops:
                print_loops(cu, args.arch, work, args.loops)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

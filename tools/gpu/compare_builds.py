"""Compare the machine code of the shipped megakernel builds between two source trees, without a GPU.

    python tools/gpu/compare_builds.py BASE [NEW] [--out DIR] [--jobs N]

BASE and NEW are repository trees (a folder, or a git ref that is exported to a temporary folder; NEW defaults
to this checkout). Each tree's own Python assembles the CUDA text of every shipped build (kernels/build.py: its
defines, its sources) and nvcc compiles it to PTX for the build's architecture. Where both sides' PTX is the
same (comments aside), ptxas makes the same SASS of it. Where it is not, ptxas and cuobjdump give the SASS of
both, and DIR/<build>.diff holds the unified diff of the two disassemblies per kernel (addresses stripped, so
an inserted instruction shows once). Results are cached in DIR by the hash of the generated text.

The shipped builds: the default (scalar FMA) GEMV and the tensor-core GEMV (`ONESTREAM_MK_GEMV=tensor`), at 1, 4
and 8 tokens per launch, for the 27B shapes and the embedded model, on sm_90 (H200: 132 SMs, 227 KB of shared
memory per block) and sm_86 (RTX 3090: 82 SMs, 99 KB); the per-phase timing builds of `onestream bench` (27B,
sm_90); and the bf16-activation build (`ONESTREAM_MK_FP32_ACT=0`). cuobjdump and nvdisasm come from PATH or the
pip packages nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARCHS = {"sm_90": (132, 227 * 1024), "sm_86": (82, 99 * 1024)}  # SMs, opt-in shared memory per block
PACKAGE_PARTS = ("kernels", "worker", "cluster", "protos")

# Run inside each tree's package: writes <name>.cu for every build into argv[1] and prints the names as JSON.
# Trees from before kernels/plan.py have KernelSpec and Tuning in kernels/build.py.
EMIT = r"""
import json, sys
# Only this tree's files: an editable install's finder would resolve a module this tree lacks from the checkout.
sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
from pathlib import Path
from onestream.kernels.build import assemble_source
try:
    from onestream.kernels.plan import KernelPlan as KernelSpec
    from onestream.kernels.tuning import Tuning
except ImportError:
    from onestream.kernels.build import KernelSpec, Tuning
from onestream.kernels.random_model import config_27b
from onestream.worker.config import ModelConfig

out = Path(sys.argv[1])
archs = json.loads(sys.argv[2])
import onestream.worker
models = {
    "27b": config_27b(),
    "embedded": ModelConfig.from_dir(Path(onestream.worker.__file__).parent / "assets" / "default_model"),
}
builds = {}
for model, config in models.items():
    for arch, (sms, smem) in archs.items():
        for t in (1, 4, 8):
            for gemv in ("scalar", "tensor"):
                builds[f"{model}-{arch}-T{t}-{gemv}"] = (config, arch, t, dict(mma=gemv == "tensor"))
for t in (1, 4, 8):
    for gemv in ("scalar", "tensor"):
        builds[f"27b-sm_90-T{t}-{gemv}-timing"] = (models["27b"], "sm_90", t, dict(mma=gemv == "tensor", phase_timing=True))
for t in (1, 4):
    builds[f"27b-sm_90-T{t}-scalar-bf16act"] = (models["27b"], "sm_90", t, dict(mma=False, fp32_act=False))
names = {}
for name, (config, arch, t, fields) in builds.items():
    sms, smem = archs[arch]
    spec = KernelSpec(config, num_sms=sms, tokens_per_launch=t, tuning=Tuning(**fields), smem_limit=smem)
    (out / f"{name}.cu").write_text(assemble_source(spec))
    names[name] = arch
print(json.dumps(names))
"""


def tool(name: str) -> str:
    """A CUDA binary utility from PATH, else from its pip package (nvidia/cu*/bin beside this Python's packages)."""
    found = shutil.which(name)
    if found:
        return found
    for base in map(Path, sys.path):
        for candidate in sorted(base.glob(f"nvidia/cu*/bin/{name}")):
            return str(candidate)
    raise SystemExit(f"{name} not found: put it on PATH or pip install nvidia-cuda-{name}")


def export_tree(ref: str, into: Path) -> Path:
    """A folder holding `ref`: the folder itself, or the commit's files exported with git archive."""
    if Path(ref).is_dir():
        return Path(ref).resolve()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_in_tree(tree: Path, work: Path, script: str, *args: str) -> str:
    """Run `script` with that tree's own package (its folders linked under work/pkg, no $ONESTREAM_MK_* settings):
    its standard output."""
    pkg = work / "pkg"
    shutil.copytree(tree / "onestream", pkg / "onestream")
    for part in PACKAGE_PARTS:
        if (tree / part).is_dir():
            os.symlink(tree / part, pkg / "onestream" / part)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONESTREAM_MK_")}
    env["PYTHONPATH"] = str(pkg)
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=pkg, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: generating the sources failed:\n{proc.stderr}")
    return proc.stdout


def emit_sources(tree: Path, work: Path) -> dict[str, str]:
    """The generated CUDA text of every build, by that tree's own build code: {build name: arch}."""
    src = work / "src"
    src.mkdir(parents=True)
    out = run_in_tree(tree, work, EMIT, str(src), json.dumps(ARCHS))
    return json.loads(out.strip().splitlines()[-1])


def nvcc_ptx(source: Path, arch: str, cache: Path) -> Path:
    """The PTX of the source for `arch` (cached by the text's hash), its comment lines dropped: they name the
    temporary file and the compiler, not the program."""
    key = hashlib.sha256(source.read_bytes() + arch.encode()).hexdigest()[:24]
    ptx = cache / f"{key}.ptx"
    if not ptx.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "mk.ptx"
            cmd = ["nvcc", f"-arch={arch}", "--std=c++17", "-ftz=true", "-ptx", "-o", str(raw), str(source)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"nvcc failed for {source.name}:\n{proc.stdout}{proc.stderr}")
            lines = [line for line in raw.read_text().splitlines() if not line.lstrip().startswith("//")]
        ptx.write_text("\n".join(lines) + "\n")
    return ptx


def disassemble(ptx: Path, arch: str) -> str:
    """SASS of the PTX's kernels (ptxas for `arch`, then cuobjdump), addresses stripped (cached beside the PTX)."""
    sass = ptx.with_suffix(".sass")
    if not sass.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "mk.cubin"
            subprocess.run(
                ["ptxas", f"-arch={arch}", str(ptx), "-o", str(cubin)], check=True, capture_output=True
            )
            env = {**os.environ, "PATH": f"{Path(tool('nvdisasm')).parent}:{os.environ.get('PATH', '')}"}
            dump = subprocess.run(
                [tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True, env=env
            ).stdout
        lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).rstrip() for line in dump.splitlines()]
        sass.write_text("\n".join(line for line in lines if line.strip()) + "\n")
    return sass.read_text()


def functions(text: str, header: str) -> dict[str, list[str]]:
    """A listing split per function: lines after each line matching `header` (whose group 1 names it)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(header, line)
        if m:
            current = m.group(1)
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


SASS_FUNCTION = r"\s*Function : (\S+)"
PTX_FUNCTION = r"^(?:\.visible |\.weak )?(?:\.entry|\.func)\s+(?:\([^)]*\)\s*)?(\w+)"
_PTX_NAME = re.compile(r"%(?:rd|rs|r|p|fd|f|h|hh)\d+|\$L__\w+")


def canonical_ptx(lines: list[str]) -> list[str]:
    """A function's PTX with its virtual registers and labels reduced to their kind (%r, %rd, %p, ..., $L) and
    the register declarations dropped: what is left is the instruction stream, its opcodes, immediates,
    offsets and branch structure, so that one instruction more or fewer shows as itself instead of renumbering
    every register after it. ptxas allocates the registers; the SASS comparison checks that."""
    return [
        _PTX_NAME.sub(lambda m: "$L" if m.group(0).startswith("$") else re.sub(r"\d+", "", m.group(0)), line)
        for line in lines
        if not line.strip().startswith(".reg ")
    ]


def _diff(a: dict[str, list[str]], b: dict[str, list[str]], label: str) -> tuple[list[str], list[str]]:
    """Unified diff lines and a per-function summary of two listings split per function."""
    diff, parts = [], []
    for f in sorted(a.keys() | b.keys()):
        if a.get(f) == b.get(f):
            continue
        lines = list(
            difflib.unified_diff(a.get(f, []), b.get(f, []), f"base/{f}", f"new/{f}", lineterm="", n=2)
        )
        diff += lines
        minus = sum(1 for x in lines if x.startswith("-") and not x.startswith("---"))
        plus = sum(1 for x in lines if x.startswith("+") and not x.startswith("+++"))
        parts.append(f"{f} -{minus} +{plus} of {len(a.get(f, []))} {label} lines")
    return diff, parts


def compare(base: Path, new: Path, out: Path, jobs: int, sass_patterns: list[str]) -> int:
    """Every build: its PTX (raw, then with registers and labels renamed), and for the builds named by
    `sass_patterns` (fnmatch; where the PTX differs) the SASS of every kernel."""
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "cache"
    cache.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        names = {side: emit_sources(tree, Path(tmp) / side) for side, tree in (("base", base), ("new", new))}
        common = [n for n in names["base"] if n in names["new"]]
        missing = sorted(set(names["base"]) ^ set(names["new"]))

        def source(side: str, name: str) -> Path:
            return Path(tmp) / side / "src" / f"{name}.cu"

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            ptx_jobs = {
                (side, n): pool.submit(nvcc_ptx, source(side, n), names["base"][n], cache)
                for n in common
                for side in ("base", "new")
            }
            ptx = {job: f.result().read_text() for job, f in ptx_jobs.items()}
            same_text = {n for n in common if source("base", n).read_text() == source("new", n).read_text()}
            differ = [n for n in common if ptx[("base", n)] != ptx[("new", n)]]
            wanted = [n for n in differ if any(fnmatch.fnmatch(n, pat) for pat in sass_patterns)]
            sass_jobs = {
                (side, n): pool.submit(disassemble, ptx_jobs[(side, n)].result(), names["base"][n])
                for n in wanted
                for side in ("base", "new")
            }
            sass = {job: f.result() for job, f in sass_jobs.items()}
    report, exact = [], 0
    for n in common:
        if n not in differ:
            exact += 1
            how = "the same generated source" if n in same_text else "the generated sources differ"
            report.append(f"{n}: PTX identical ({how}), so the SASS is too")
            continue
        a = {f: canonical_ptx(x) for f, x in functions(ptx[("base", n)], PTX_FUNCTION).items()}
        b = {f: canonical_ptx(x) for f, x in functions(ptx[("new", n)], PTX_FUNCTION).items()}
        diff, parts = _diff(a, b, "PTX")
        if not parts:
            line = f"{n}: PTX identical up to register and label names"
        else:
            (out / f"{n}.ptx.diff").write_text("\n".join(diff) + "\n")
            line = f"{n}: PTX differs ({'; '.join(parts)}): {out / (n + '.ptx.diff')}"
        if n in wanted:
            sdiff, sparts = _diff(
                functions(sass[("base", n)], SASS_FUNCTION),
                functions(sass[("new", n)], SASS_FUNCTION),
                "SASS",
            )
            if sparts:
                (out / f"{n}.sass.diff").write_text("\n".join(sdiff) + "\n")
                line += f"; SASS differs ({'; '.join(sparts)}): {out / (n + '.sass.diff')}"
            else:
                line += "; SASS identical"
        report.append(line)
    for n in missing:
        report.append(f"{n}: only in {'base' if n in names['base'] else 'new'}")
    text = "\n".join(report)
    (out / "report.txt").write_text(text + "\n")
    print(text)
    print(f"{exact} of {len(common)} builds have identical PTX")
    return 0 if exact == len(common) and not missing else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("base", help="base tree: a folder or a git ref (e.g. main)")
    parser.add_argument("new", nargs="?", default=str(REPO), help="new tree (default: this checkout)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/onestream-compare-builds"))
    parser.add_argument("--jobs", type=int, default=2, help="compilations at once")
    parser.add_argument(
        "--sass",
        default="27b-sm_90-T1-scalar,27b-sm_90-T4-tensor",
        help="builds (comma-separated fnmatch patterns, '*' for all) whose SASS is compared where their PTX differs "
        "(ptxas takes minutes per 27B build); default: the T = 1 step and the T = 4 tensor-core verify",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = export_tree(args.base, Path(tmp) / "base")
        new = export_tree(args.new, Path(tmp) / "new")
        return compare(base, new, args.out, args.jobs, [p for p in args.sass.split(",") if p])


if __name__ == "__main__":
    sys.exit(main())

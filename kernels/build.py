"""Build the decode megakernel of a plan: source assembly and compilation.

The CUDA sources (kernels/*.cu, *.cuh) take every shape and layout as a compile-time constant: a `KernelPlan`
(kernels/plan.py) gives them as defines. `assemble_source` puts those in front of megakernel.cu with its
headers inlined (so the compile cache key covers every line); `compile_module` builds it with NVRTC through
CuPy for the GPU present, and CuPy keeps the binary in its on-disk cache (`$CUPY_CACHE_DIR`, default
`~/.cupy/kernel_cache`), so later runs skip compilation. `nvcc_compile` builds the same text with nvcc (the
compile-only test and the register/spill report use it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .plan import KernelPlan

CUDA_DIR = Path(__file__).resolve().parent
MAIN_SOURCE = "megakernel.cu"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def _define_text(name: str, value: int | float) -> str:
    if isinstance(value, float):
        return f"#define {name} {value!r}f"
    return f"#define {name} {int(value)}"


def assemble_source(plan: KernelPlan) -> str:
    """One self-contained CUDA text: the constants, then megakernel.cu with its headers inlined once each."""
    lines = [f"// onestream megakernel, generated for {plan.config.model_type}; do not edit"]
    lines += [_define_text(k, v) for k, v in plan.defines().items()]
    seen: set[str] = set()

    def inline(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        path = CUDA_DIR / name
        for line in path.read_text().splitlines():
            m = _INCLUDE.match(line)
            if m:
                inline(m.group(1))
            elif line.strip() != "#pragma once":
                lines.append(line)

    inline(MAIN_SOURCE)
    return "\n".join(lines) + "\n"


@dataclass
class BuiltModule:
    module: Any  # cupy.RawModule
    plan: KernelPlan
    compile_s: float
    kernels: dict[str, Any] = dataclasses.field(default_factory=dict)

    def kernel(self, name: str) -> Any:
        if name not in self.kernels:
            self.kernels[name] = self.module.get_function(name)
        return self.kernels[name]

    def resources(self, name: str = "mk_decode") -> dict[str, int]:
        k = self.kernel(name)
        return {"registers": int(k.num_regs), "local_bytes": int(k.local_size_bytes)}


_MODULES: dict[KernelPlan, BuiltModule] = {}


def compile_module(plan: KernelPlan) -> BuiltModule:
    """Compile (or fetch from the in-process and on-disk caches) the kernels for the current CUDA device."""
    if plan in _MODULES:
        return _MODULES[plan]
    import cupy

    source = assemble_source(plan)
    start = time.perf_counter()
    module = cupy.RawModule(code=source, options=("--std=c++17",), enable_cooperative_groups=True)
    module.compile()
    built = BuiltModule(module, plan, time.perf_counter() - start)
    _MODULES[plan] = built
    return built


def nvcc_compile(
    plan: KernelPlan,
    arch: str,
    *,
    ptxas_verbose: bool = True,
    nvcc: str | None = None,
    extra_source: str = "",
) -> str:
    """Compile the assembled source (and `extra_source` after it: test kernels) with nvcc for `arch` (e.g.
    "sm_90"); return the compiler's messages.

    Raises `RuntimeError` with the compiler output if the build fails.
    """
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "megakernel_generated.cu"
        src.write_text(assemble_source(plan) + extra_source)
        cmd = [
            nvcc,
            f"-arch={arch}",
            "--std=c++17",
            "-ftz=true",
            "-c",
            str(src),
            "-o",
            str(Path(tmp) / "mk.o"),
        ]
        if ptxas_verbose:
            cmd += ["-Xptxas", "-v"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        out = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{out}")
        return out


def ptxas_report(messages: str) -> dict[str, dict[str, int]]:
    """Registers, spill stores/loads and stack frame per kernel or device function, from `-Xptxas -v`.

    A function compiled for several kernels appears once per kernel: its entry keeps the largest figures.
    """
    report: dict[str, dict[str, int]] = {}
    current = None
    for line in messages.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = m.group(1)
            report.setdefault(current, {})
            continue
        if current is None:
            continue
        entry = report[current]
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            for key, value in zip(
                ("stack", "spill_stores", "spill_loads"), map(int, m.groups()), strict=True
            ):
                entry[key] = max(entry.get(key, 0), value)
        m = re.search(r"Used (\d+) registers", line)
        if m:
            entry["registers"] = max(entry.get("registers", 0), int(m.group(1)))
    return report

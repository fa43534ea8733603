"""The prefill's Triton kernels (worker/prefill/triton_kernels.py) compile for Hopper (sm_90, the H200) and Ampere
(sm_86, the RTX 3090) at the 27B shapes, without a GPU: Triton compiles ahead of time for a named target with the
ptxas it ships. The interpreter the other CPU tests run them under accepts code the compiler would refuse; this
checks what the GPU will build.

Triton decides at import whether kernels compile or interpret, and the test session imports it interpreting
(tests/conftest.py), so the compiles run in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

# The compile-time constants each kernel gets at the 27B shapes (the wrappers' choices in triton_kernels.py).
CONSTANTS = {
    "_rms_norm": {"ROWS": 1, "BLOCK": 8192},  # hidden 5120
    "_gated_rms_norm": {"ROWS": 32, "BLOCK": 128},  # value heads of 128
    "_conv_silu": {"KEYS": 2048, "SPAN": 3, "BT": 32, "BC": 128},  # 16 key heads of 128, kernel 4
    "_gates": {"BLOCK": 1024},
    "_silu_mul": {"BLOCK": 1024},
    "_head_norm_rope": {"WIDTH": 256, "ROT": 64, "ROWS": 8},  # heads of 256, a quarter rotated
    "_gated_heads": {"WIDTH": 256, "ROWS": 8},
}

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from onestream.worker.prefill import triton_kernels

    constants, arch = json.loads(sys.argv[1]), int(sys.argv[2])
    for name, const in constants.items():
        kernel = getattr(triton_kernels, name)
        signature = {}
        for arg in kernel.arg_names:  # pointers to bf16 (g is fp32), sizes and strides i32, eps fp32
            if arg in const:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = "*fp32" if arg == "g_ptr" else "*bf16"
            else:
                signature[arg] = "fp32" if arg == "eps" else "i32"
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=const), target=GPUTarget("cuda", arch, 32)
        )
        assert compiled.asm["cubin"], name
        print(name, "shared", compiled.metadata.shared)
    """
)


@pytest.mark.parametrize("arch", [90, 86])
def test_the_kernels_compile_for_the_gpus(arch: int) -> None:
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(CONSTANTS), str(arch)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line.split()[0] for line in done.stdout.splitlines()]
    assert compiled == list(CONSTANTS), done.stdout
    for line in done.stdout.splitlines():  # every kernel fits the shared memory of one block on both GPUs
        assert int(line.split()[-1]) <= 99 * 1024, line

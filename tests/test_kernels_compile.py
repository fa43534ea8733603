"""Compile-only check of the megakernel's CUDA sources with nvcc (CI runs it where nvcc is on PATH).

The exact text the run-time NVRTC build compiles (constants of a config inlined) must build for Hopper
(sm_90, the H200) and Ampere (sm_86, the RTX 3090), for the tiny test shapes and the 27B shapes.
"""

from __future__ import annotations

import shutil

import pytest
from onestream.kernels.build import KernelSpec, Tuning, nvcc_compile, ptxas_report
from onestream.kernels.random_model import config_27b
from onestream.worker.testing import tiny_config

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

SMS = {"sm_90": 132, "sm_86": 82}
SMEM = {"sm_90": 227 * 1024, "sm_86": 99 * 1024}  # opt-in shared memory per block
KERNELS = {"mk_decode", "mk_phase", "mk_barrier_test"}


@pytest.mark.parametrize("arch", ["sm_90", "sm_86"])
@pytest.mark.parametrize("shape", ["tiny", "27b"])
def test_sources_compile(shape: str, arch: str) -> None:
    config = tiny_config() if shape == "tiny" else config_27b()
    spec = KernelSpec(config, num_sms=SMS[arch], smem_limit=SMEM[arch])
    report = ptxas_report(nvcc_compile(spec, arch))
    assert report.keys() >= KERNELS, report
    for name in KERNELS:
        # One resident block per SM needs the registers of the whole block to fit the register file.
        assert report[name]["registers"] * spec.tuning.threads <= 65536, (name, report[name])
    print(f"\n{shape} {arch}: {report['mk_decode']}")


@pytest.mark.parametrize(
    "tuning",
    [
        Tuning(variant=0, stages=0),
        Tuning(phase_timing=True),
        Tuning(stages=3),
        Tuning(fp32_act=False),
        Tuning(dynamic=True),
        Tuning(fp32_gemv_in=True, dynamic=True),
        Tuning(mma=True),
        Tuning(mma=True, dynamic=True),
    ],
    ids=[
        "previous-kernel",
        "phase-timing",
        "ring-forced",
        "bf16-activations",
        "dynamic-rows",
        "fp32-inputs",
        "tensor-cores",
        "tensor-cores-dynamic",
    ],
)
def test_variants_compile(tuning: Tuning) -> None:
    """The switches the bench sweeps (the previous kernel, the timing build, bf16 activations, dynamic rows) and the shared-memory weight ring
    (sm_80+ cp.async: it compiles for sm_86 too, where it only lacks the room) build for 27B shapes."""
    both = tuning.stages == 3 or tuning.fp32_gemv_in or tuning.mma
    for arch in ("sm_90", "sm_86") if both else ("sm_90",):
        spec = KernelSpec(config_27b(), num_sms=SMS[arch], tuning=tuning, smem_limit=SMEM["sm_90"])
        report = ptxas_report(nvcc_compile(spec, arch))
        assert report["mk_decode"]["registers"] * spec.tuning.threads <= 65536, report["mk_decode"]
        print(f"\n{tuning} {arch}: stages {spec.stages} {report['mk_decode']}")

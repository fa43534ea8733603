"""Compile-only check of the megakernel's CUDA sources with nvcc (CI runs it where nvcc is on PATH).

The exact text the run-time NVRTC build compiles (constants of a config inlined) must build for Hopper
(sm_90, the H200) and Ampere (sm_86, the RTX 3090), for the tiny test shapes and the 27B shapes.
"""

from __future__ import annotations

import shutil

import pytest
from onestream.kernels.build import KernelSpec, nvcc_compile, ptxas_report
from onestream.kernels.random_model import config_27b
from onestream.worker.testing import tiny_config

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

SMS = {"sm_90": 132, "sm_86": 82}
KERNELS = {"mk_decode", "mk_phase", "mk_barrier_test"}


@pytest.mark.parametrize("arch", ["sm_90", "sm_86"])
@pytest.mark.parametrize("shape", ["tiny", "27b"])
def test_sources_compile(shape: str, arch: str) -> None:
    config = tiny_config() if shape == "tiny" else config_27b()
    spec = KernelSpec(config, num_sms=SMS[arch])
    report = ptxas_report(nvcc_compile(spec, arch))
    assert report.keys() >= KERNELS, report
    for name in KERNELS:
        # One resident block per SM needs the registers of the whole block to fit the register file.
        assert report[name]["registers"] * spec.tuning.threads <= 65536, (name, report[name])
    print(f"\n{shape} {arch}: {report['mk_decode']}")

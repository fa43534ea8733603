"""Compile-only check of the megakernel's CUDA sources with nvcc (CI runs it where nvcc is on PATH).

The exact text the run-time NVRTC build compiles (constants of a config inlined) must build for Hopper
(sm_90, the H200) and Ampere (sm_86, the RTX 3090), for the tiny test shapes and the 27B shapes.
"""

from __future__ import annotations

import shutil

import pytest
from onestream.kernels.build import nvcc_compile, ptxas_report
from onestream.kernels.plan import KernelPlan
from onestream.kernels.random_model import config_27b
from onestream.kernels.tuning import Tuning
from onestream.worker.errors import UnsupportedModelError
from onestream.worker.testing import tiny_config

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

SMS = {"sm_90": 132, "sm_86": 82}
SMEM = {"sm_90": 227 * 1024, "sm_86": 99 * 1024}  # opt-in shared memory per block
KERNELS = {"mk_decode", "mk_phase", "mk_barrier_test"}


@pytest.mark.parametrize("arch", ["sm_90", "sm_86"])
@pytest.mark.parametrize("shape", ["tiny", "27b"])
def test_sources_compile(shape: str, arch: str) -> None:
    config = tiny_config() if shape == "tiny" else config_27b()
    spec = KernelPlan(config, num_sms=SMS[arch], smem_limit=SMEM[arch])
    report = ptxas_report(nvcc_compile(spec, arch))
    assert report.keys() >= KERNELS, report
    for name in KERNELS:
        # One resident block per SM needs the registers of the whole block to fit the register file.
        assert report[name]["registers"] * spec.tuning.threads <= 65536, (name, report[name])
    print(f"\n{shape} {arch}: {report['mk_decode']}")


@pytest.mark.parametrize(
    ("tuning", "arch"),
    [
        (Tuning(phase_timing=True), "sm_90"),
        (Tuning(fp32_act=False), "sm_90"),
        (Tuning(mma=True), "sm_90"),
        (Tuning(mma=True), "sm_86"),
    ],
    ids=["phase-timing", "bf16-activations", "tensor-cores", "tensor-cores-sm86"],
)
def test_shipped_switches_compile(tuning: Tuning, arch: str) -> None:
    """The switches a shipped build sets (the bench's timing build, the bf16 numerics, the tensor-core GEMV with
    its weight ring on sm_90 and its register path on sm_86) build for the 27B shapes."""
    spec = KernelPlan(config_27b(), num_sms=SMS[arch], tuning=tuning, smem_limit=SMEM[arch])
    report = ptxas_report(nvcc_compile(spec, arch))
    assert report["mk_decode"]["registers"] * spec.tuning.threads <= 65536, report["mk_decode"]
    print(f"\n{tuning} {arch}: stages {spec.stages} {report['mk_decode']}")


def test_an_int8_cache_plan_defines_it_and_others_keep_their_defines() -> None:
    plain = KernelPlan(config_27b(), num_sms=132, smem_limit=227 * 1024)
    int8 = KernelPlan(config_27b(), num_sms=132, smem_limit=227 * 1024, kv_cache="int8")
    assert "MK_KV_I8" not in plain.defines()
    assert {**plain.defines(), "MK_KV_I8": 1} == int8.defines()
    with pytest.raises(UnsupportedModelError, match="KV cache format"):
        KernelPlan(config_27b(), num_sms=132, smem_limit=227 * 1024, kv_cache="fp8")


@pytest.mark.parametrize(("arch", "tokens"), [("sm_90", 8), ("sm_86", 1)])
def test_the_int8_cache_builds_compile(arch: str, tokens: int) -> None:
    """The attention phase reading int8 keys and values builds for the H200's widest verify and the RTX 3090's
    decode step, its block's registers within the register file."""
    plan = KernelPlan(
        config_27b(), num_sms=SMS[arch], tokens_per_launch=tokens, smem_limit=SMEM[arch], kv_cache="int8"
    )
    report = ptxas_report(nvcc_compile(plan, arch))
    assert report["mk_decode"]["registers"] * plan.tuning.threads <= 65536, report["mk_decode"]
    attention = next(v for k, v in report.items() if "phase_attention" in k)
    print(f"\nint8 KV {arch} T = {tokens}: mk_decode {report['mk_decode']}, attention {attention}")

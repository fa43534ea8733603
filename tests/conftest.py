"""Shared test setup: every test sees the kernel's default numerics and GEMV, whatever the shell exports.

The megakernel's environment switches ($ONESTREAM_MK_FP32_ACT, $ONESTREAM_MK_FP32_IN, $ONESTREAM_MK_GEMV) pick a
default `Tuning`; tests name the builds they compare, so an operator's setting must not turn a scalar build
into a tensor-core one (or make `Tuning(fp32_gemv_in=True)` invalid) behind their back. Tests of the switches
set them again with monkeypatch.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

KERNEL_ENV = ("ONESTREAM_MK_FP32_ACT", "ONESTREAM_MK_FP32_IN", "ONESTREAM_MK_GEMV")


@pytest.fixture(scope="session", autouse=True)
def _kernel_defaults() -> Iterator[None]:
    # Session scope: the module-scoped fixtures that build runners are set up after it.
    with pytest.MonkeyPatch.context() as mp:
        for name in KERNEL_ENV:
            mp.delenv(name, raising=False)
        yield

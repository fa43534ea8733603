"""Shared test setup: every test sees the kernel's default numerics and GEMV, whatever the shell exports.

The megakernel's environment settings ($ONESTREAM_MK_FP32_ACT, $ONESTREAM_MK_GEMV) choose the `Tuning` that
the back-end creation and the CLI resolve (kernels/tuning.py `tuning_from_env`); tests that
create a back end must not get a tensor-core build behind their back. Tests of the settings set them again with
monkeypatch.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

KERNEL_ENV = ("ONESTREAM_MK_FP32_ACT", "ONESTREAM_MK_GEMV")


@pytest.fixture(scope="session", autouse=True)
def _kernel_defaults() -> Iterator[None]:
    # Session scope: the module-scoped fixtures that build runners are set up after it.
    with pytest.MonkeyPatch.context() as mp:
        for name in KERNEL_ENV:
            mp.delenv(name, raising=False)
        yield

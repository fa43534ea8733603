"""Shared test setup: every test sees the kernel's default numerics and GEMV, whatever the shell exports;
the pool tests get their Ray cluster, router and client from the fixtures below.

The megakernel's environment settings ($ONESTREAM_MK_FP32_ACT, $ONESTREAM_MK_GEMV) choose the `Tuning` that
the back-end creation and the CLI resolve (kernels/tuning.py `tuning_from_env`); tests that
create a back end must not get a tensor-core build behind their back. Tests of the settings set them again with
monkeypatch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

# `python -m pytest` puts the checkout's root first on sys.path, where its kernels/ folder (installed as
# onestream.kernels) would shadow the `kernels` package that transformers imports. The tests import the project
# as onestream.*; the root stays reachable, last, for the scripts under tools/.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_AT_ROOT = [p for p in sys.path if os.path.abspath(p or os.curdir) == _ROOT]
sys.path[:] = [p for p in sys.path if p not in _AT_ROOT] + _AT_ROOT

# Without a GPU, Triton's kernels (worker/prefill/triton_kernels.py) can only run interpreted: it must be told
# before it is imported, which decides then whether a kernel compiles or interprets.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

if TYPE_CHECKING:  # imported where used: most test modules never start a pool
    from onestream.cluster.client import PoolClient
    from onestream.cluster.server import PoolThread
    from ray.cluster_utils import Cluster

KERNEL_ENV = ("ONESTREAM_MK_FP32_ACT", "ONESTREAM_MK_GEMV")


@pytest.fixture(scope="session", autouse=True)
def _kernel_defaults() -> Iterator[None]:
    # Session scope: the module-scoped fixtures that build runners are set up after it.
    with pytest.MonkeyPatch.context() as mp:
        for name in KERNEL_ENV:
            mp.delenv(name, raising=False)
        yield


# ---- a pool on a local Ray cluster (tests/test_pool*.py, tests/test_frontdoor_http.py) -----------------
# One cluster and one router per module that asks for `pool`: Ray's start-up dominates on 2 cores. A module
# shapes its pool by overriding `pool_cards`, `pool_model_dir` and `pool_settings`.
POOL_START_TIMEOUT_S = 180.0  # cards starting on a busy 2-core machine


@pytest.fixture(scope="module")
def pool_cards() -> tuple[int, ...]:
    """CPU card slots of each node of the module's cluster, the head first."""
    return (2,)


@pytest.fixture(scope="module")
def pool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The checkpoint the cards load: a tiny random one unless the module needs real text."""
    from onestream.worker.testing import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny"))


@pytest.fixture(scope="module")
def pool_settings() -> dict[str, Any]:
    """`PoolConfig` fields the module sets over `cpu_pool_config`'s."""
    return {}


@pytest.fixture(scope="module")
def cluster(pool_cards: tuple[int, ...]) -> Iterator[Cluster]:
    from onestream.cluster.testing import running_cluster

    with running_cluster(pool_cards) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def pool(
    cluster: Cluster, pool_cards: tuple[int, ...], pool_model_dir: str, pool_settings: dict[str, Any]
) -> Iterator[PoolThread]:
    from onestream.cluster.server import PoolThread
    from onestream.cluster.testing import cpu_pool_config

    pool = PoolThread(cpu_pool_config(pool_model_dir, **pool_settings))
    try:
        yield pool.start(wait_for_cards=sum(pool_cards), ready_timeout_s=POOL_START_TIMEOUT_S)
    finally:
        pool.stop()


@pytest.fixture(scope="module")
def grpc_client(pool: PoolThread) -> Iterator[PoolClient]:
    from onestream.cluster.client import PoolClient

    with PoolClient(pool.grpc_address, timeout_s=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def client(grpc_client: PoolClient) -> PoolClient:
    """The pool's gRPC client, under the name most pool tests use (a module may override it)."""
    return grpc_client

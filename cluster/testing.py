"""Pools on one machine, for the tests and the soak: a multi-node Ray cluster of CPU cards
(`ray.cluster_utils.Cluster`), the router settings tests run it with, and a bounded wait. tests/conftest.py
builds its pool fixtures from these, cluster/soak.py its pool.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .card import CPU_CARD_RESOURCE
from .config import PoolConfig

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

T = TypeVar("T")

POLL_S = 0.2  # how often `wait_for` asks: well under any timeout it is given, cheap on 2 cores
# Ray declares a node dead after 5 failed health checks 3 s apart, which a raylet starved ~30 s on a loaded
# machine misses; 20 ride out ~75 s, and a removed node still leaves at once (its raylet unregisters on SIGTERM).
HEAD_SYSTEM_CONFIG = {"health_check_failure_threshold": 20}
NODE_START_TIMEOUT = "timed out during startup"  # what ray._private.node.Node raises after its 30 s
NODE_START_ATTEMPTS = 3

logger = logging.getLogger(__name__)


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    """The first truthy value of `predicate`; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def add_card_node(cluster: Cluster, cards: int = 1) -> Any:
    """A node of one CPU advertising `cards` CPU card slots (the router places one card on each).

    Ray gives a new raylet a fixed 30 s to register with the GCS, which a raylet starved on a loaded 2-core
    host can miss; such a half-started node is killed and started again, up to NODE_START_ATTEMPTS times."""
    for attempt in range(1, NODE_START_ATTEMPTS + 1):
        try:
            return cluster.add_node(num_cpus=1, resources={CPU_CARD_RESOURCE: cards})
        except Exception as error:
            if NODE_START_TIMEOUT not in str(error) or attempt == NODE_START_ATTEMPTS:
                raise
            logger.warning("a Ray node missed its startup deadline (attempt %d); starting it again", attempt)
            _kill_half_started_node(error)
    raise AssertionError("unreachable")


def _kill_half_started_node(error: BaseException) -> None:
    """Kill the processes of the node whose `Node.__init__` raised `error`: Ray returns no handle to it, so it
    is taken from the raising frame."""
    from ray._private.node import Node

    traceback = error.__traceback__
    while traceback is not None:
        node = traceback.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            node.kill_all_processes(check_alive=False, allow_graceful=False)
            return
        traceback = traceback.tb_next


def start_cluster(cards_per_node: Sequence[int]) -> Cluster:
    """A Ray cluster on this machine, a node per entry (the head first) advertising that many CPU card
    slots; this process is connected to it (`ray.init`)."""
    import ray
    from ray.cluster_utils import Cluster

    head, *others = cards_per_node
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {CPU_CARD_RESOURCE: head},
            "include_dashboard": False,
            "_system_config": HEAD_SYSTEM_CONFIG,
        },
    )
    for cards in others:
        add_card_node(cluster, cards)
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    return cluster


def stop_cluster(cluster: Cluster) -> None:
    import ray

    ray.shutdown()
    cluster.shutdown()


@contextlib.contextmanager
def running_cluster(cards_per_node: Sequence[int]) -> Iterator[Cluster]:
    cluster = start_cluster(cards_per_node)
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


def cpu_pool_config(model_dir: str, **settings: Any) -> PoolConfig:
    """A router for a `start_cluster` cluster: free loopback ports, a card wherever a node advertises a
    CPU card slot, one torch thread per card (a test machine has few cores), card calls and membership
    changes bounded for a busy machine; `settings` override any of it."""
    defaults: dict[str, Any] = {
        "grpc_address": "127.0.0.1:0",
        "metrics_address": "127.0.0.1:0",
        "cpu_cards": 0,  # cards where nodes advertise the slots, none started by the router's own node
        "card_torch_threads": 1,
        "call_timeout_s": 30.0,
        "discovery_interval_s": 1.0,
    }
    return PoolConfig(model_dir=model_dir, **{**defaults, **settings})

"""A card seen live while it loads: `ListCards` and `onestream status` show it `loading` with a rising fraction
(posted by the card through the registry's LoadBoard), then free. The load is slow enough to watch because the
pool quantizes its checkpoint on load (`engine_options`' `quantize`, what `serve --quantize` sets)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import grpc
import pytest
from onestream.protos.onestream.v1 import onestream_pb2 as pb

WATCH_TIMEOUT_S = 240.0  # a card starting on a busy 2-core machine
# 8 layers of 512-wide rows: quantizing its 14 M weights on load takes seconds, a load of a tiny model does not
CONFIG_FIELDS: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "head_dim": 128,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}


@pytest.fixture(scope="module")
def pool_cards() -> tuple[int, ...]:
    return (1,)


@pytest.fixture(scope="module")
def pool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    import torch
    from onestream.worker.config import default_layer_types
    from onestream.worker.testing import tiny_config, write_tiny_checkpoint

    config = tiny_config(**CONFIG_FIELDS, layer_types=default_layer_types(8, 4))
    return str(
        write_tiny_checkpoint(tmp_path_factory.mktemp("model") / "m", config=config, dtype=torch.bfloat16)
    )


@pytest.fixture(scope="module")
def starting_pool(cluster: Any, pool_model_dir: str) -> Iterator[tuple[Any, Future[None]]]:
    """A pool whose start runs on its loop while the test watches (its start returns once a card serves)."""
    from onestream.cluster.server import PoolThread
    from onestream.cluster.testing import cpu_pool_config

    pool = PoolThread(cpu_pool_config(pool_model_dir, engine_options={"quantize": "q8_0"}))
    started = pool.submit(pool.pool.start(wait_for_cards=1, ready_timeout_s=WATCH_TIMEOUT_S))
    try:
        deadline = time.monotonic() + WATCH_TIMEOUT_S
        while getattr(pool.pool, "grpc_port", None) is None and not started.done():  # the port is bound first
            assert time.monotonic() < deadline, "the pool's gRPC port never opened"
            time.sleep(0.05)
        yield pool, started
    finally:
        pool.stop()


def test_a_starting_card_shows_loading_with_a_rising_fraction_then_free(
    starting_pool: tuple[Any, Future[None]], capsys: pytest.CaptureFixture[str]
) -> None:
    from onestream.cluster.client import PoolClient

    from onestream.cli import main

    pool, started = starting_pool
    fractions: list[float] = []
    status_lines: list[str] = []
    deadline = time.monotonic() + WATCH_TIMEOUT_S
    with PoolClient(pool.grpc_address, timeout_s=60.0) as client:
        while time.monotonic() < deadline:
            try:
                cards = client.cards()
            except grpc.RpcError:  # bound, but the server or the registry is not started yet
                time.sleep(0.1)
                continue
            states = [c.state for c in cards]
            if states == [pb.CARD_STATE_FREE]:
                break
            loading = [c for c in cards if c.state == pb.CARD_STATE_LOADING]
            if loading:
                fractions.append(loading[0].loading_fraction)
                if not status_lines and 0.0 < loading[0].loading_fraction < 1.0:
                    assert main(["status", "--server", pool.grpc_address]) == 0
                    status_lines = [
                        line for line in capsys.readouterr().out.splitlines() if "loading" in line
                    ]
            time.sleep(0.1)
        started.result(WATCH_TIMEOUT_S)  # the pool's start returned: its card serves
        assert [c.state for c in client.cards()] == [pb.CARD_STATE_FREE], "the card never came up"
    assert fractions == sorted(fractions), fractions  # it only rises
    assert len({f for f in fractions if 0.0 < f < 1.0}) >= 2, fractions  # seen partway, more than once
    shown = [int(m.group(1)) for line in status_lines if (m := re.search(r"loading (\d+)%", line))]
    assert len(shown) == 1 and 0 <= shown[0] <= 100, status_lines  # `onestream status` caught it loading

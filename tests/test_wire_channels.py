"""The pool's gRPC channels (cluster/wire.py) against a real server that goes away and comes back on the
same port, as a restarted router does: a client that called while it was down reaches it again within the
capped reconnection backoff, not gRPC's default (up to 120 s)."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from onestream.cluster import wire


def serve(port: int) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=wire.server_options())
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, bound


def check(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        return True
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        return False


def test_a_client_that_called_while_the_server_was_down_finds_it_back_within_the_capped_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wire, "MAX_RECONNECT_BACKOFF_MS", 500)  # read when a channel is made
    server, port = serve(0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=wire.channel_options())
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        assert check(stub)
        server.stop(grace=None).wait()
        down_until = time.monotonic() + 3.0  # gRPC's own backoff would have grown to 2.6 s by now
        while time.monotonic() < down_until:
            assert not check(stub)
            time.sleep(0.1)
        server, _ = serve(port)
        back = time.monotonic()
        while not check(stub):
            assert time.monotonic() - back < 1.5, "the channel did not reconnect within its backoff"
            time.sleep(0.05)
        print(f"reached again {time.monotonic() - back:.2f}s after the server came back")
    finally:
        channel.close()
        server.stop(grace=None)

"""`onestream serve` as users run it: its own local Ray, one CPU card, a real client; SIGHUP re-reads the
API keys; SIGTERM drains (the in-flight stream finishes) and the process exits cleanly. A GGUF file serves the
same way, and its card's metrics and `onestream status` name the file's weights format."""

from __future__ import annotations

import json
import secrets
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from onestream.cluster.client import PoolClient, make_request
from onestream.worker.testing import write_tiny_checkpoint
from pool_helpers import Serve, scrape, total

pytestmark = pytest.mark.slow
START_TIMEOUT_S = 240.0
KEYS = {user: secrets.token_urlsafe(24) for user in ("cli", "gone", "new")}


@pytest.fixture(scope="module")
def keys_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"{KEYS['cli']} cli\n{KEYS['gone']} gone\n")
    return path


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, keys_path: Path) -> Iterator[Serve]:
    model_dir = write_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny")
    server = Serve(
        "--model", str(model_dir), "--cpu-cards", "1", "--max-context", "512", "--api-keys", str(keys_path)
    )
    yield server
    server.kill()


def test_serve_prints_its_addresses_serves_rereads_keys_on_sighup_and_drains_on_sigterm(
    serve: Serve, keys_path: Path
) -> None:
    grpc_address = serve.wait_for_line(r"gRPC\s+(\S+:\d+)", START_TIMEOUT_S).group(1)
    http_address = serve.wait_for_line(r"HTTP\s+http://(\S+)/v1", 10).group(1)
    metrics_address = serve.wait_for_line(r"metrics\s+http://(\S+)/metrics", 10).group(1)
    serve.wait_for_line(r"card\s+\S+/0/cpu-0", 10)
    serve.wait_for_line(r"API keys\s+2 keys of 2 users", 10)
    serve.wait_for_line(r"ready", 10)
    gone, new = (PoolClient(grpc_address, timeout_s=60, api_key=KEYS[user]) for user in ("gone", "new"))
    with PoolClient(grpc_address, timeout_s=60, api_key=KEYS["cli"]) as client, gone, new:
        assert gone.pool_status().cards_free == 1
        keys_path.write_text(f"{KEYS['cli']} cli\n{KEYS['new']} new\n")
        serve.process.send_signal(signal.SIGHUP)
        serve.wait_for_line(r"SIGHUP: re-read", 30)
        with pytest.raises(grpc.RpcError) as removed:
            gone.pool_status()
        assert removed.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert new.pool_status().cards_free == 1
        assert client.health() == "SERVING"
        assert client.model_info().max_context == 512
        events = list(client.generate(make_request("def main():", session_id="cli", max_tokens=5)))
        assert events[-1].finished.usage.generated_tokens > 0
        with urllib.request.urlopen(f"http://{metrics_address}/sd", timeout=10) as response:
            assert b'"card"' in response.read()
        models = urllib.request.Request(
            f"http://{http_address}/v1/models", headers={"Authorization": f"Bearer {KEYS['cli']}"}
        )
        with urllib.request.urlopen(models, timeout=10) as response:
            assert json.load(response)["data"][0]["id"] == "tiny"

        in_flight = client.generate(make_request("x", session_id="long", max_tokens=500, ignore_eos=True))
        first = next(e for e in in_flight if e.WhichOneof("event") == "chunk")
        assert first.chunk.token_ids
        serve.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while client.health() != "NOT_SERVING" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.health() == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as refused:
            list(client.generate(make_request("y", max_tokens=2)))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        rest = list(in_flight)  # the stream in flight finishes despite the signal
        assert rest[-1].finished.usage.generated_tokens == 500
    assert serve.process.wait(120) == 0, "".join(serve.output)[-4000:]
    serve.wait_for_line(r"stopped", 5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU default only applies without a GPU")
def test_plain_serve_runs_the_embedded_model_on_cpu_cards_without_a_gpu() -> None:
    """The README's main command: no --model, no --cpu-cards, on a machine without a GPU."""
    server = Serve()
    try:
        server.wait_for_line(r"no GPU here; running 2 CPU cards", START_TIMEOUT_S)
        grpc_address = server.wait_for_line(r"gRPC\s+(\S+:\d+)", START_TIMEOUT_S).group(1)
        server.wait_for_line(r"ready", 30)
        with PoolClient(grpc_address, timeout_s=60) as client:
            assert len(client.cards()) == 2
            events = list(client.generate(make_request("import os\n", session_id="readme", max_tokens=8)))
            finished = events[-1].finished
            assert finished.usage.generated_tokens > 0
            assert finished.usage.draft_tokens > 0  # the embedded model drafts with its MTP head
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(120) == 0, "".join(server.output)[-4000:]
    finally:
        server.kill()


def test_serve_a_gguf_file_and_its_card_shows_the_weights_and_kv_cache_formats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`onestream quantize` writes a Q4_K_M GGUF; `onestream serve --model X.gguf --kv-cache int8` serves it; the
    card's /metrics (a real scrape) label it `gguf Q4_K_M` and `kv_cache="int8"` in `onestream_card_info` and
    count what it streamed."""
    from onestream.cli import main

    model_dir = write_tiny_checkpoint(tmp_path / "tiny")
    gguf = tmp_path / "tiny-q4_k_m.gguf"
    assert main(["quantize", "--model", str(model_dir), "--type", "q4_k_m", "--out", str(gguf)]) == 0
    server = Serve(
        "--model",
        str(gguf),
        "--cpu-cards",
        "1",
        "--max-context",
        "256",
        "--http",
        "off",
        "--kv-cache",
        "int8",
    )
    try:
        grpc_address = server.wait_for_line(r"gRPC\s+(\S+:\d+)", START_TIMEOUT_S).group(1)
        card_metrics = server.wait_for_line(r"card\s+\S+/0/cpu-0\s.*http://(\S+)/metrics", 10).group(1)
        server.wait_for_line(r"ready", 10)
        with PoolClient(grpc_address, timeout_s=60) as client:
            assert client.model_info().format == "gguf Q4_K_M"
            events = list(client.generate(make_request("def main():", max_tokens=6, ignore_eos=True)))
            assert events[-1].finished.usage.generated_tokens == 6
        samples = scrape(card_metrics)
        assert (
            total(samples, "onestream_card_info", format="gguf Q4_K_M", backend="reference", kv_cache="int8")
            == 1
        )
        assert total(samples, "onestream_card_info") == 1  # one identity series: no other format label
        assert total(samples, "onestream_generation_tokens_total") == 6
        capsys.readouterr()
        assert main(["status", "--server", grpc_address]) == 0
        assert "[gguf Q4_K_M] on reference" in capsys.readouterr().out
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(120) == 0, "".join(server.output)[-4000:]
    finally:
        server.kill()

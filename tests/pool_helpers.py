"""Helpers of the pool tests (tests/conftest.py has their fixtures): a Generate call read to its end on
this or a background thread, real scrapes of the router's and the cards' /metrics, and `onestream serve`
run as a process."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from onestream.cluster.client import PoolClient
from onestream.protos.onestream.v1 import onestream_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families

STREAM_TIMEOUT_S = 180.0  # a whole turn, queueing included, on a busy 2-core machine

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Turn:
    """Everything one Generate call streamed back."""

    positions: list[int] = field(default_factory=list)
    assigned: list[pb.Assigned] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: pb.Finished | None = None
    error: grpc.RpcError | None = None
    first_chunk: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    call: Any = None

    @property
    def card_id(self) -> str:
        return self.assigned[-1].card.card_id


def run_turn(
    client: PoolClient,
    request: pb.GenerateRequest,
    turn: Turn | None = None,
    timeout_s: float = STREAM_TIMEOUT_S,
) -> Turn:
    turn = turn or Turn()
    turn.call = client.generate(request, timeout_s=timeout_s)
    try:
        for event in turn.call:
            kind = event.WhichOneof("event")
            if kind == "queued":
                turn.positions.append(event.queued.position)
            elif kind == "assigned":
                turn.assigned.append(event.assigned)
            elif kind == "chunk":
                turn.token_ids += event.chunk.token_ids
                turn.text += event.chunk.text
                turn.first_chunk.set()
            elif kind == "finished":
                turn.finished = event.finished
    except grpc.RpcError as e:
        turn.error = e
    finally:
        turn.first_chunk.set()
        turn.done.set()
    return turn


def start_turn(client: PoolClient, request: pb.GenerateRequest) -> Turn:
    """Run a turn on a background thread; wait on `first_chunk` / `done`."""
    turn = Turn()
    threading.Thread(target=run_turn, args=(client, request, turn), daemon=True).start()
    return turn


def new_session() -> str:
    return f"s-{uuid.uuid4().hex[:10]}"


def http_get(address: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=30) as response:
        return response.read().decode()


def assert_idle(client: PoolClient, cards: int = 1) -> None:
    """The pool serves again: nothing in flight, no card busy or down, `cards` free (bounded wait), and its
    gRPC health service says SERVING."""
    deadline = time.monotonic() + 30
    while True:
        status = client.pool_status()
        if status.in_flight == 0 and status.cards_busy == 0 and status.cards_free == cards:
            break
        assert time.monotonic() < deadline, f"the pool did not come back to idle: {status}"
        time.sleep(0.05)
    assert client.health() == "SERVING"


def scrape(address: str) -> Samples:
    """Every sample of a real /metrics scrape, keyed by (name, sorted labels)."""
    samples = {}
    for family in text_string_to_metric_families(http_get(address, "/metrics")):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples that carry `labels`."""
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == val for k, val in labels.items())
    )


class Serve:
    """A running `onestream serve` in its own process group, its output lines collected on a thread."""

    def __init__(self, *args: str, listen: str = "127.0.0.1:0", http: str = "127.0.0.1:0") -> None:
        command = [
            sys.executable, "-m", "onestream", "serve", *args,
            "--listen", listen, "--metrics", "127.0.0.1:0", "--http", http, "--card-threads", "1",
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"`onestream serve` never printed {pattern!r}:\n{''.join(self.output)[-4000:]}")

    def kill(self) -> None:
        """SIGKILL its process group (a crash, or the end of a test), if it still runs."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

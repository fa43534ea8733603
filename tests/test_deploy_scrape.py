"""A real Prometheus scrapes a real local pool through the shipped config, after real traffic.

`onestream serve --cpu-cards 2` (tiny random checkpoint) runs in a subprocess with its own local Ray
instance; Prometheus (Debian's package) runs with deploy/prometheus/prometheus.yml.tmpl rendered for the
local router and 1 s intervals, and the shipped rules. After a few gRPC turns through the pool's client,
every dashboard query, every recording rule and every alert rule is evaluated through Prometheus' HTTP API.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import requests
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD_FILES = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
PROMETHEUS = shutil.which("prometheus")
CARDS = 2
MAX_TOKENS = 12
SPEC_K = 2
T = TypeVar("T")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="prometheus not installed (Debian package `prometheus`; tools/bootstrap.sh installs it)",
    ),
]


# ---- helpers --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float, interval_s: float = 0.5) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")


def stop_process(process: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM (the pool drains), then SIGKILL of the process group we started."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def load_render_config() -> Any:
    name = "onestream_deploy_render_config"
    spec = importlib.util.spec_from_file_location(name, PROMETHEUS_DIR / "render_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Pool:
    grpc_address: str
    metrics_address: str
    process: subprocess.Popen[Any]
    log: Path


class PrometheusAPI:
    def __init__(self, address: str) -> None:
        self.base = f"http://{address}"

    def get(self, path: str, **params: Any) -> Any:
        response = requests.get(f"{self.base}{path}", params=params, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def series(self, selector: str) -> list[dict[str, str]]:
        return self.get("/api/v1/series", **{"match[]": selector})

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


@dataclass
class Traffic:
    started: float  # time.time() when the first request went out
    finished: list[Any] = field(default_factory=list)  # pb.Finished of every completed turn
    queued_positions: list[int] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)  # status code name -> count

    def total(self, usage_field: str) -> int:
        return sum(getattr(f.usage, usage_field) for f in self.finished)

    def per_card(self, usage_field: str) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for f in self.finished:
            counts[f.card.gpu_uuid] += getattr(f.usage, usage_field)
        return {card: n for card, n in counts.items() if n}


# ---- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    from onestream.cluster.client import PoolClient
    from onestream.worker.testing import write_tiny_checkpoint

    work = tmp_path_factory.mktemp("pool")
    model_dir = write_tiny_checkpoint(work / "model", seed=random.randrange(1 << 30))
    grpc_address, metrics_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    # A Ray instance of our own: RAY_ADDRESS=local never joins another cluster on this machine, and a
    # private (short: unix socket paths are limited) temp dir keeps its files apart.
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = dict(os.environ, RAY_ADDRESS="local", RAY_TMPDIR=ray_tmp, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = work / "serve.log"
    command = [
        *(sys.executable, "-m", "onestream", "serve"),
        *(
            "--cpu-cards",
            str(CARDS),
            "--model",
            str(model_dir),
            "--card-threads",
            "1",
            "--spec-k",
            str(SPEC_K),
        ),
        *("--listen", grpc_address, "--metrics", metrics_address, "--http", "off"),
    ]
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        with PoolClient(grpc_address, timeout_s=2.0) as client:

            def all_cards_serving() -> bool:
                if process.poll() is not None:
                    pytest.fail(
                        f"onestream serve exited with {process.returncode}:\n{log.read_text()[-4000:]}"
                    )
                try:
                    return (
                        client.health() == "SERVING"
                        and len(client.cards()) == CARDS
                        and all(c.metrics_endpoint for c in client.cards())
                    )
                except grpc.RpcError:
                    return False

            wait_for("the pool to serve on every card", all_cards_serving, timeout_s=150)
        yield Pool(grpc_address, metrics_address, process, log)
    finally:
        stop_process(process, grace_s=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def prometheus(pool: Pool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusAPI]:
    assert PROMETHEUS is not None
    work = tmp_path_factory.mktemp("prometheus")
    config = load_render_config().render_config(
        pool.metrics_address,
        scrape_interval="1s",
        evaluation_interval="1s",
        sd_refresh_interval="1s",
        rules_dir=str(PROMETHEUS_DIR / "rules"),
    )
    (work / "prometheus.yml").write_text(config)
    address = f"127.0.0.1:{free_port()}"
    log = work / "prometheus.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address={address}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    api = PrometheusAPI(address)
    try:

        def ready() -> bool:
            if process.poll() is not None:
                pytest.fail(f"prometheus exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                return requests.get(f"{api.base}/-/ready", timeout=2).status_code == 200
            except requests.ConnectionError:
                return False

        wait_for("Prometheus to be ready", ready, timeout_s=30)
        yield api
    finally:
        stop_process(process, grace_s=10)


@pytest.fixture(scope="module")
def targets(prometheus: PrometheusAPI) -> list[dict[str, Any]]:
    def all_up() -> list[dict[str, Any]] | None:
        active = prometheus.get("/api/v1/targets", state="active")["activeTargets"]
        return active if len(active) == CARDS + 1 and all(t["health"] == "up" for t in active) else None

    return wait_for("the router and every card to be scraped", all_up, timeout_s=30)


@pytest.fixture(scope="module")
def labels_before_traffic(
    prometheus: PrometheusAPI, targets: list[dict[str, Any]]
) -> dict[str, dict[str, set[str]]]:
    """Per card, the finish reasons and draft positions it exports before serving anything."""
    exported: dict[str, dict[str, set[str]]] = {
        t["labels"]["gpu_uuid"]: {"finish_reason": set(), "position": set()}
        for t in targets
        if t["labels"]["role"] == "card"
    }
    for metric, label in (
        ("onestream_requests_total", "finish_reason"),
        ("onestream_spec_decode_num_accepted_tokens_per_pos_total", "position"),
    ):
        for series in prometheus.series(metric):
            exported[series["gpu_uuid"]][label].add(series[label])
    return exported


@pytest.fixture(scope="module")
def traffic(
    pool: Pool,
    prometheus: PrometheusAPI,
    targets: list[dict[str, Any]],
    labels_before_traffic: dict[str, dict[str, set[str]]],
) -> Traffic:
    """Two sessions of two turns each and two one-off requests, four at a time on two cards (so some
    queue), and one invalid request. Returns once Prometheus has scraped all of it."""
    from onestream.cluster.client import PoolClient, make_request

    rng = random.Random()
    traffic = Traffic(started=time.time())
    lock = threading.Lock()

    def turn(client: PoolClient, prompt: str, session_id: str) -> str:
        text = []
        for event in client.generate(
            make_request(prompt, session_id=session_id, max_tokens=MAX_TOKENS, temperature=0.0), timeout_s=120
        ):
            kind = event.WhichOneof("event")
            with lock:
                if kind == "queued":
                    traffic.queued_positions.append(event.queued.position)
                elif kind == "chunk":
                    text.append(event.chunk.text)
                elif kind == "finished":
                    traffic.finished.append(event.finished)
        return "".join(text)

    def concurrently(jobs: list[Callable[[], str]]) -> list[str]:
        results: list[str] = [""] * len(jobs)
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                results[i] = jobs[i]()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors, errors
        return results

    prompts = {
        f"session-{rng.randrange(1 << 32):08x}": f"def f{rng.randrange(1000)}(x):\n    return x * {rng.randrange(100)}\n"
        for _ in range(2)
    }
    with PoolClient(pool.grpc_address) as client:
        one_offs = [f"# {rng.randrange(1 << 20)}\nimport os\n" for _ in range(2)]
        first = concurrently(
            [
                *(lambda p=p, s=s: turn(client, p, s) for s, p in prompts.items()),
                *(lambda p=p: turn(client, p, "") for p in one_offs),
            ]
        )
        # Second turns extend the first ones: the home card serves the cached prefix.
        concurrently(
            [
                lambda p=p, s=s, r=r: turn(client, p + r + "\nprint(1)\n", s)
                for (s, p), r in zip(prompts.items(), first, strict=False)
            ]
        )
        try:
            list(client.generate(make_request("x = 1", max_tokens=4, temperature=-1.0), timeout_s=30))
        except grpc.RpcError as e:
            traffic.rejected[e.code().name] += 1

    # Every target scraped twice after the last request: counters are final and rates have two samples.
    ended = time.time()
    wait_for(
        "two scrapes of every target after the traffic",
        lambda: all(
            _timestamp(t["lastScrape"]) > ended + 1.0
            for t in prometheus.get("/api/v1/targets", state="active")["activeTargets"]
        ),
        timeout_s=20,
    )
    expected_tokens = traffic.total("generated_tokens")
    wait_for(
        "Prometheus to scrape every generated token",
        lambda: prometheus.value("sum(onestream_generation_tokens_total)") == expected_tokens,
        timeout_s=30,
    )
    wait_for(
        "Prometheus to scrape every finished request",
        lambda: prometheus.value("sum(onestream_requests_total)") == len(traffic.finished),
        timeout_s=30,
    )
    return traffic


def rate_window(traffic: Traffic) -> str:
    """What Grafana's $__rate_interval stands for in the test: a window spanning all of the traffic."""
    return f"{int(time.time() - traffic.started) + 30}s"


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) of every panel query."""
    queries = []
    for path in DASHBOARD_FILES:
        dashboard = json.loads(path.read_text())
        panels = [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]
        for panel in panels:
            for target in panel.get("targets", []):
                queries.append((dashboard["uid"], panel["title"], target["expr"]))
    return queries


def substitute(expr: str, *, node: str, card: str, window: str) -> str:
    """Grafana's interpolation of the dashboard variables (a multi-value selection becomes a regex)."""
    return expr.replace("$__rate_interval", window).replace("$node", node).replace("$card", card)


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    return [float(r["value"][1]) for r in result if math.isfinite(float(r["value"][1]))]


# ---- tests ----------------------------------------------------------------------------------------


def test_discovery_finds_the_router_and_every_card(pool: Pool, targets: list[dict[str, Any]]) -> None:
    from onestream.cluster.client import PoolClient

    with PoolClient(pool.grpc_address) as client:
        cards = {c.metrics_endpoint: c for c in client.cards()}
    by_role: dict[str, list[dict[str, Any]]] = {}
    for target in targets:
        by_role.setdefault(target["labels"]["role"], []).append(target)
        assert target["labels"]["job"] == "onestream"
    (router,) = by_role["router"]
    assert router["labels"]["instance"] == pool.metrics_address
    assert {t["labels"]["instance"] for t in by_role["card"]} == set(cards)
    for target in by_role["card"]:
        card = cards[target["labels"]["instance"]]
        assert target["labels"]["node"] == card.node_id
        assert target["labels"]["gpu_index"] == str(card.gpu_index)
        assert target["labels"]["gpu_uuid"] == card.gpu_uuid == f"cpu-{card.gpu_index}"


def test_scraped_counters_match_the_traffic(traffic: Traffic, prometheus: PrometheusAPI) -> None:
    assert len(traffic.finished) == 6
    assert traffic.queued_positions, "four concurrent requests on two cards: some should have queued"
    assert traffic.rejected == {"INVALID_ARGUMENT": 1}

    def per_card(metric: str) -> dict[str, int]:
        return {
            r["metric"]["gpu_uuid"]: int(float(r["value"][1]))
            for r in prometheus.query(f"sum by (gpu_uuid) ({metric})")
            if float(r["value"][1]) > 0
        }

    assert per_card("onestream_generation_tokens_total") == traffic.per_card("generated_tokens")
    assert per_card("onestream_prompt_tokens_total") == traffic.per_card("prompt_tokens")
    assert per_card("onestream_cached_prompt_tokens_total") == traffic.per_card("cached_prompt_tokens")
    assert traffic.total("cached_prompt_tokens") > 0, "second turns should reuse their session's cache"
    assert per_card("onestream_spec_decode_num_draft_tokens_total") == traffic.per_card("draft_tokens")
    assert per_card("onestream_spec_decode_num_accepted_tokens_total") == traffic.per_card(
        "accepted_draft_tokens"
    )
    assert traffic.total("draft_tokens") > 0, "speculative decoding should have drafted"
    assert prometheus.value('sum(onestream_router_rejections_total{reason="invalid_argument"})') == 1
    assert prometheus.value("sum(onestream_request_queue_time_seconds_count)") == len(traffic.finished)


def test_every_dashboard_query_returns_data(traffic: Traffic, prometheus: PrometheusAPI) -> None:
    """Each panel query, with every card selected and with the busiest card alone, returns finite values."""
    busiest = max(traffic.per_card("generated_tokens").items(), key=lambda kv: kv[1])[0]
    node = next(f.card.node_id for f in traffic.finished if f.card.gpu_uuid == busiest)
    selections = {"all cards": (".*", ".*"), f"card {busiest}": (node, busiest)}
    window = rate_window(traffic)
    queries = dashboard_queries()
    assert len(queries) >= 40
    empty = []
    for uid, title, expr in queries:
        for selection, (node_value, card_value) in selections.items():
            query = substitute(expr, node=node_value, card=card_value, window=window)
            if not finite_values(prometheus.query(query)):
                empty.append(f"{uid} / {title} ({selection}): {query}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_cards_export_their_labelled_series_before_the_first_request(
    labels_before_traffic: dict[str, dict[str, set[str]]],
) -> None:
    """A labelled counter that appears at its first increment hides that increment from rate() and
    increase(), so the panels would miss it: every card exports its finish reasons and draft positions
    at zero from the start."""
    assert set(labels_before_traffic) == {f"cpu-{i}" for i in range(CARDS)}
    for card, labels in labels_before_traffic.items():
        assert {"stop", "length"} <= labels["finish_reason"], (card, labels)
        assert {str(p) for p in range(SPEC_K)} <= labels["position"], (card, labels)


def test_rates_over_the_traffic_count_the_first_event_of_every_series(
    traffic: Traffic, prometheus: PrometheusAPI
) -> None:
    """What the panels chart as rates counts every finished request and accepted draft of the traffic."""
    window = rate_window(traffic)
    for reason in {f.finish_reason for f in traffic.finished}:
        seen = prometheus.value(
            f'sum(increase(onestream_requests_total{{finish_reason="{reason}"}}[{window}]))'
        )
        assert seen, f"finished requests with reason {reason!r} are invisible to rate()"
    for position in range(SPEC_K):
        accepted = sum(
            f.usage.accepted_per_position[position]
            for f in traffic.finished
            if len(f.usage.accepted_per_position) > position
        )
        series = f'onestream_spec_decode_num_accepted_tokens_per_pos_total{{position="{position}"}}'
        assert prometheus.query(series), f"no series for draft position {position}"
        if accepted:
            seen = prometheus.value(f"sum(increase({series}[{window}]))")
            assert seen, f"{accepted} drafts accepted at position {position} are invisible to rate()"


def test_dashboard_variables_list_the_nodes_and_cards(traffic: Traffic, prometheus: PrometheusAPI) -> None:
    expected_cards = {f"cpu-{i}" for i in range(CARDS)}
    expected_nodes = {f.card.node_id for f in traffic.finished}
    for path in DASHBOARD_FILES:
        variables = {v["name"]: v for v in json.loads(path.read_text())["templating"]["list"]}
        values = {}
        for name in ("node", "card"):
            selector, label = re.fullmatch(
                r"label_values\((.+), (\w+)\)", variables[name]["definition"]
            ).groups()
            selector = selector.replace("$node", ".*")
            values[name] = {s[label] for s in prometheus.series(selector)}
        assert values == {"node": expected_nodes, "card": expected_cards}, path.name


def test_every_recording_rule_returns_data(traffic: Traffic, prometheus: PrometheusAPI) -> None:
    records = [
        rule["record"]
        for group in yaml.safe_load((PROMETHEUS_DIR / "rules" / "recording.yml").read_text())["groups"]
        for rule in group["rules"]
    ]
    for record in records:
        result = wait_for(
            f"recorded series {record}",
            lambda record=record: finite_values(prometheus.query(record)),
            timeout_s=20,
        )
        assert result, record
    # The values mean what they say: the pool's tok/s is the sum of the cards'.
    cards = sum(finite_values(prometheus.query("card:onestream_generation_tokens:rate1m")))
    pool = sum(finite_values(prometheus.query("model:onestream_generation_tokens:rate1m")))
    assert pool == pytest.approx(cards)
    from onestream.worker.drafting import DEFAULT_LOOKUP_K

    lengths = finite_values(prometheus.query("card:onestream_spec_decode_mean_accepted_length:rate5m"))
    assert all(1.0 <= v <= 1.0 + max(SPEC_K, DEFAULT_LOOKUP_K) for v in lengths), lengths  # copies draft more


def test_alert_rules_are_valid_and_quiet(traffic: Traffic, prometheus: PrometheusAPI) -> None:
    after_traffic = time.time()

    def evaluated_since_traffic() -> list[dict[str, Any]] | None:
        groups = prometheus.get("/api/v1/rules")["groups"]
        newest = [g["lastEvaluation"] for g in groups]
        ok = all(_timestamp(t) > after_traffic for t in newest)
        return groups if ok else None

    groups = wait_for("a rule evaluation after the traffic", evaluated_since_traffic, timeout_s=20)
    alerts = [r for g in groups for r in g["rules"] if r["type"] == "alerting"]
    shipped = {
        r["alert"]
        for g in yaml.safe_load((PROMETHEUS_DIR / "rules" / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
    }
    assert {a["name"] for a in alerts} == shipped
    for rule in (r for g in groups for r in g["rules"]):
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
    for alert in alerts:
        assert alert["state"] == "inactive", (alert["name"], alert["alerts"])
        assert prometheus.query(alert["query"]) == [], alert["name"]
        # Valid: every series the alert watches exists in this pool (a typo would keep it quiet forever).
        watched = set(
            re.findall(r"(?<![\w:])(?:(?:card|model):)?onestream_[a-z0-9_]+(?::[a-z0-9_]+)?", alert["query"])
        )
        if re.search(r"\bup\{", alert["query"]):
            watched.add("up")
        assert watched, alert["name"]
        for name in watched:
            assert prometheus.query(f'count({{__name__="{name}"}})'), (alert["name"], name)
    assert prometheus.get("/api/v1/alerts")["alerts"] == []


def _timestamp(rfc3339: str) -> float:
    """Prometheus' RFC 3339 timestamps (nanoseconds, `Z` or an offset) as seconds since the epoch."""
    from datetime import datetime

    match = re.fullmatch(r"(.+T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", rfc3339)
    assert match, rfc3339
    whole, fraction, zone = match.groups()
    offset = "+00:00" if zone == "Z" else zone
    return datetime.fromisoformat(whole + offset).timestamp() + float(fraction or 0)

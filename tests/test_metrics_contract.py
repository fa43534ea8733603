"""The metric names and labels of docs/metrics.md are exactly what the card and router export, over a
real HTTP scrape of the metrics server."""

from __future__ import annotations

import json
import random
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from onestream.cluster.http_server import MetricsHTTPServer
from onestream.cluster.metrics import CARD_LABELS, CardMetrics, RouterMetrics
from onestream.worker.api import DraftUsage, Finished, Timings, Usage
from prometheus_client.parser import text_string_to_metric_families

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
ROW = re.compile(r"^\|\s*`(onestream_[a-z0-9_]+)`\s*\|\s*([a-z]+)[^|]*\|\s*([^|]*)\|")


def documented() -> dict[str, list[tuple[str, str, set[str]]]]:
    """Rows of the doc's two tables: (name, type, labels), card rows first then router rows."""
    tables: dict[str, list[tuple[str, str, set[str]]]] = {"card": [], "router": []}
    current = "card"
    for line in DOC.read_text().splitlines():
        if line.startswith("Router"):
            current = "router"
        match = ROW.match(line)
        if match:
            name, kind, labels = match.groups()
            labels = re.sub(r"\([^)]*\)", "", labels)  # drop the lists of label values
            tables[current].append((name, kind, set(re.findall(r"`([a-z_]+)`", labels))))
    return tables


def serve_and_scrape(registry: object, routes: dict | None = None) -> tuple[str, MetricsHTTPServer]:
    server = MetricsHTTPServer("127.0.0.1", 0, registry, routes)  # type: ignore[arg-type]
    with urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode(), server


def families(text: str) -> dict[str, tuple[str, set[str]]]:
    """sample-family name as PromQL sees it -> (type, label names)."""
    found = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = set().union(*(set(s.labels) for s in family.samples)) - {"le"}
        found[name] = (family.type, labels)
    return found


def card_metrics() -> CardMetrics:
    metrics = CardMetrics(
        node="abc123", gpu_index=1, gpu_uuid="GPU-1234", model="tiny", backend="reference", device_name="cpu"
    )
    metrics.generation_tokens.inc(7)
    metrics.observe_finished(
        Finished(
            "stop",
            Usage(
                prompt_tokens=11,
                cached_prompt_tokens=4,
                generated_tokens=7,
                drafts=3,
                draft_tokens=6,
                accepted_draft_tokens=5,
                accepted_per_position=[3, 2],
                by_source={"mtp": DraftUsage(2, 4, 3, [2, 1]), "lookup": DraftUsage(1, 2, 2, [1, 1])},
            ),
            Timings(time_to_first_token_s=0.02, inter_token_s=[0.01, 0.012], total_s=0.1),
        )
    )
    return metrics


def test_the_doc_lists_both_tables() -> None:
    tables = documented()
    assert len(tables["card"]) >= 15 and len(tables["router"]) >= 7


def test_card_metrics_match_the_doc() -> None:
    text, server = serve_and_scrape(card_metrics().registry)
    server.close()
    exported = families(text)
    for name, kind, extra in documented()["card"]:
        assert name in exported, f"{name} is documented but not exported"
        assert exported[name][0] == kind, name
        assert exported[name][1] == set(CARD_LABELS) | extra, name
    undocumented = set(exported) - {n for n, _, _ in documented()["card"]}
    assert not undocumented, f"exported but not in docs/metrics.md: {undocumented}"


def test_the_card_info_names_its_kv_cache_format() -> None:
    metrics = CardMetrics(
        node="abc123",
        gpu_index=0,
        gpu_uuid="GPU-1",
        model="tiny",
        backend="reference",
        device_name="cpu",
        kv_cache="int8",
    )
    text, server = serve_and_scrape(metrics.registry)
    server.close()
    line = next(line for line in text.splitlines() if line.startswith("onestream_card_info{"))
    assert 'kv_cache="int8"' in line and line.endswith(" 1.0")


def test_router_metrics_match_the_doc() -> None:
    metrics = RouterMetrics("tiny", per_user=True)
    metrics.observe_queue_time("0123456789ab/0/cpu-0", 0.5)
    metrics.add_user("alice")
    text, server = serve_and_scrape(metrics.registry)
    server.close()
    exported = families(text)
    for name, kind, labels in documented()["router"]:
        assert name in exported, f"{name} is documented but not exported"
        assert exported[name][0] == kind, name
        assert exported[name][1] == {"model"} | labels, name
    assert set(exported) == {n for n, _, _ in documented()["router"]}


def test_per_user_counters_have_no_user_label_unless_asked_and_count_what_happened() -> None:
    users = {f"user{i}": (random.randint(1, 40), random.randint(1, 40)) for i in range(3)}

    def observe(metrics: RouterMetrics) -> dict[tuple[str, str | None], float]:
        for user in users:
            metrics.add_user(user)  # as the router does for the key file's users
        for user, (prompt, generated) in users.items():
            metrics.user_request(user)
            metrics.user_tokens(user, prompt=prompt)
            metrics.user_tokens(user, generated=generated)
        metrics.user_rejected("user0", "user_queued")
        text, server = serve_and_scrape(metrics.registry)
        server.close()
        return {
            (s.name, s.labels.get("user")): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("onestream_router_user_") and s.labels.get("reason") in (None, "user_queued")
        }

    aggregated = observe(RouterMetrics("m"))
    assert {user for _, user in aggregated} == {None}
    assert aggregated[("onestream_router_user_requests_total", None)] == len(users)
    assert aggregated[("onestream_router_user_prompt_tokens_total", None)] == sum(
        p for p, _ in users.values()
    )
    assert aggregated[("onestream_router_user_generation_tokens_total", None)] == sum(
        g for _, g in users.values()
    )
    assert aggregated[("onestream_router_user_rejections_total", None)] == 1
    per_user = observe(RouterMetrics("m", per_user=True))
    for user, (prompt, generated) in users.items():
        assert per_user[("onestream_router_user_requests_total", user)] == 1
        assert per_user[("onestream_router_user_prompt_tokens_total", user)] == prompt
        assert per_user[("onestream_router_user_generation_tokens_total", user)] == generated
    assert per_user[("onestream_router_user_rejections_total", "user0")] == 1
    assert per_user[("onestream_router_user_rejections_total", "user1")] == 0


def test_card_counts_are_what_was_observed() -> None:
    metrics = CardMetrics(
        node="n", gpu_index=0, gpu_uuid="cpu-0", model="m", backend="reference", device_name="cpu"
    )
    requests = [(random.randint(1, 50), random.randint(0, 20), random.randint(1, 30)) for _ in range(5)]
    for prompt, cached, generated in requests:
        cached = min(cached, prompt)
        metrics.generation_tokens.inc(generated)
        metrics.observe_finished(
            Finished(
                random.choice(["stop", "length"]),
                Usage(prompt_tokens=prompt, cached_prompt_tokens=cached, generated_tokens=generated),
                Timings(time_to_first_token_s=0.01, inter_token_s=[0.001] * (generated - 1), total_s=0.05),
            )
        )
    text, server = serve_and_scrape(metrics.registry)
    server.close()
    values = {
        (s.name, s.labels.get("finish_reason")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    prompt_total = sum(min(c, p) for p, c, _ in requests)
    assert values[("onestream_generation_tokens_total", None)] == sum(g for _, _, g in requests)
    assert values[("onestream_prompt_tokens_total", None)] == sum(p for p, _, _ in requests)
    assert values[("onestream_cached_prompt_tokens_total", None)] == prompt_total
    assert values[("onestream_inter_token_latency_seconds_count", None)] == sum(g - 1 for _, _, g in requests)
    by_reason = sum(v for (n, r), v in values.items() if n == "onestream_requests_total" and r)
    assert by_reason == len(requests)


def test_json_routes_and_unknown_paths() -> None:
    groups = [{"targets": ["10.0.0.1:9000"], "labels": {"role": "card"}}]
    _, server = serve_and_scrape(RouterMetrics("m").registry, {"/sd": lambda: groups})
    try:
        with urllib.request.urlopen(f"http://{server.endpoint}/sd", timeout=10) as response:
            assert response.headers["Content-Type"] == "application/json"
            assert json.loads(response.read()) == groups
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://{server.endpoint}/nope", timeout=10)
        assert missing.value.code == 404 and b"/sd" in missing.value.read()
    finally:
        server.close()


def test_labelled_card_series_exist_at_zero_before_any_request() -> None:
    spec_k = random.randint(1, 4)
    metrics = CardMetrics(
        node="n",
        gpu_index=0,
        gpu_uuid="cpu-0",
        model="m",
        backend="reference",
        device_name="cpu",
        spec_k=spec_k,
    )
    text, server = serve_and_scrape(metrics.registry)
    server.close()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    reasons = {s.labels["finish_reason"]: s.value for s in samples if s.name == "onestream_requests_total"}
    assert reasons == {"stop": 0.0, "length": 0.0, "cancelled": 0.0}
    positions = {
        (s.labels["source"], s.labels["position"]): s.value
        for s in samples
        if s.name == "onestream_spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert positions == {(source, str(p)): 0.0 for source in ("mtp", "lookup") for p in range(spec_k)}
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        by_source = {
            s.labels["source"]: s.value
            for s in samples
            if s.name == f"onestream_spec_decode_num_{name}_total"
        }
        assert by_source == {"mtp": 0.0, "lookup": 0.0}, name


def test_speculative_counters_count_each_draft_source() -> None:
    """A finished request's per-source usage lands on its `source` series; a usage without a breakdown
    (an engine that only drafts with MTP) counts as MTP's."""
    metrics = card_metrics()
    metrics.observe_finished(
        Finished(
            "length",
            Usage(drafts=2, draft_tokens=4, accepted_draft_tokens=1, accepted_per_position=[1, 0]),
            Timings(),
        )
    )
    text, server = serve_and_scrape(metrics.registry)
    server.close()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def value(name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    assert value("onestream_spec_decode_num_drafts_total", source="mtp") == 2 + 2
    assert value("onestream_spec_decode_num_drafts_total", source="lookup") == 1
    assert value("onestream_spec_decode_num_draft_tokens_total", source="lookup") == 2
    assert value("onestream_spec_decode_num_accepted_tokens_total", source="mtp") == 3 + 1
    assert value("onestream_spec_decode_num_accepted_tokens_total", source="lookup") == 2
    per_pos = "onestream_spec_decode_num_accepted_tokens_per_pos_total"
    assert value(per_pos, source="lookup", position="1") == 1
    assert value(per_pos, source="mtp", position="0") == 2 + 1


def test_router_exports_each_cards_queue_wait_at_zero_before_its_first_request() -> None:
    """rate() over a series that appears with its first request misses that request: a card's queue-wait
    series must exist, at zero, from the moment the card joins."""
    metrics = RouterMetrics("tiny")
    metrics.add_card("0123456789ab/1/GPU-5c1e")
    text, server = serve_and_scrape(metrics.registry)
    server.close()
    assert (
        'onestream_request_queue_time_seconds_count{gpu_index="1",gpu_uuid="GPU-5c1e",model="tiny",'
        'node="0123456789ab"} 0.0' in text
    )

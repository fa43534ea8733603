"""deploy/grafana: the generated dashboards import as they are, and provisioning points at them."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_scripts import load_module

ROOT = Path(__file__).resolve().parents[1]
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARD_FILES = sorted((GRAFANA_DIR / "dashboards").glob("*.json"))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def documented_metrics() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(onestream_[a-z0-9_]+)` \|", text, flags=re.MULTILINE))


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Top-level panels and those nested in collapsed rows."""
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


@pytest.fixture(scope="module", params=DASHBOARD_FILES, ids=lambda p: p.name)
def dashboard(request: pytest.FixtureRequest) -> dict[str, Any]:
    return json.loads(request.param.read_text())


def test_both_dashboards_are_shipped() -> None:
    uids = {json.loads(p.read_text())["uid"] for p in DASHBOARD_FILES}
    assert uids == {"onestream-pool", "onestream-card"}


def test_checked_in_dashboards_are_the_generators_output() -> None:
    generator = load_module(GRAFANA_DIR / "generate_dashboards.py")
    built = generator.build()
    assert sorted(built) == [p.name for p in DASHBOARD_FILES]
    for path in DASHBOARD_FILES:
        assert path.read_text() == generator.render(built[path.name]), (
            f"{path.name} is stale: run the generator"
        )
    assert generator.main(["--check"]) == 0


def test_dashboard_identity(dashboard: dict[str, Any]) -> None:
    assert dashboard["id"] is None  # importable into any Grafana: the server assigns the numeric id
    assert re.fullmatch(r"[a-z0-9-]{1,40}", dashboard["uid"])
    assert dashboard["title"].startswith("onestream")
    assert isinstance(dashboard["schemaVersion"], int)
    assert "__inputs" not in dashboard  # no import-time prompts


def test_panel_ids_are_unique(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in all_panels(dashboard)]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids))


def test_every_query_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    queried = [p for p in all_panels(dashboard) if p["type"] != "row"]
    assert len(queried) >= 10
    for panel in queried:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_template_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "node", "card"}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("node", "card"):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"] == DATASOURCE
        assert variable["definition"] == variable["query"]["query"]
        assert variable["definition"].startswith("label_values(onestream_card_info")
        assert variable["includeAll"] and variable["multi"] and variable["allValue"] == ".*"
    assert "$node" in variables["card"]["definition"], "the card list follows the chosen nodes"


def test_card_panels_filter_on_node_and_card(dashboard: dict[str, Any]) -> None:
    """Every query of a card's series honours the node and card variables; router series carry neither."""
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            for selector in re.findall(
                r"(onestream_(?!router_|request_queue)[a-z0-9_]+)(\{[^}]*\})?", target["expr"]
            ):
                assert 'node=~"$node"' in selector[1] and 'gpu_uuid=~"$card"' in selector[1], (
                    panel["title"],
                    selector,
                )


def test_queries_use_documented_metrics_and_the_rate_interval(dashboard: dict[str, Any]) -> None:
    documented = documented_metrics()
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            names = {re.sub(r"_bucket$", "", n) for n in re.findall(r"onestream_[a-z0-9_]+", expr)}
            assert names <= documented, (panel["title"], names - documented)
            # Ranges follow the dashboard's time range: $__rate_interval, never a fixed window.
            assert re.findall(r"\[([^\]]*)\]", expr) == ["$__rate_interval"] * expr.count("["), panel["title"]


def test_panels_fit_the_grid_without_overlapping(dashboard: dict[str, Any]) -> None:
    boxes = [p["gridPos"] for p in all_panels(dashboard)]
    for box in boxes:
        assert box["w"] > 0 and box["h"] > 0 and box["x"] >= 0 and box["x"] + box["w"] <= 24
    for a, b in itertools.combinations(boxes, 2):
        apart = (
            a["x"] + a["w"] <= b["x"]
            or b["x"] + b["w"] <= a["x"]
            or a["y"] + a["h"] <= b["y"]
            or b["y"] + b["h"] <= a["y"]
        )
        assert apart, (a, b)


def test_overview_and_card_dashboards_cover_the_issue() -> None:
    """The panels the issue asks for, by the metrics they chart."""
    exprs = {
        json.loads(p.read_text())["uid"]: " ".join(
            t["expr"] for panel in all_panels(json.loads(p.read_text())) for t in panel.get("targets", [])
        )
        for p in DASHBOARD_FILES
    }
    for metric in (
        "onestream_generation_tokens_total",
        "onestream_card_busy",
        "onestream_router_queue_depth",
        "onestream_request_queue_time_seconds_bucket",
        "onestream_router_sessions",
        "onestream_router_rejections_total",
    ):
        assert metric in exprs["onestream-pool"], metric
    for metric in (
        "onestream_generation_tokens_total",
        "onestream_spec_decode_num_accepted_tokens_total",
        "onestream_spec_decode_num_accepted_tokens_per_pos_total",
        "onestream_spec_decode_num_drafts_total",
        "onestream_time_to_first_token_seconds_bucket",
        "onestream_inter_token_latency_seconds_bucket",
        "onestream_prefill_tokens_total",
        "onestream_cached_prompt_tokens_total",
    ):
        assert metric in exprs["onestream-card"], metric
    assert "histogram_quantile(0.99" in exprs["onestream-card"]


def test_provisioning_points_at_the_dashboards_and_prometheus() -> None:
    provider = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "onestream.yml").read_text())
    (dashboards,) = provider["providers"]
    datasources = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "onestream.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://localhost:9090"

    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    grafana_mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert grafana_mounts["./grafana/dashboards"] == dashboards["options"]["path"]
    assert grafana_mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    prometheus_flags = compose["services"]["prometheus"]["command"]
    assert "--web.listen-address=0.0.0.0:9090" in prometheus_flags
    for service in compose["services"].values():
        for volume in service["volumes"]:
            source_path = volume.split(":")[0]
            if source_path.startswith("./"):
                assert (ROOT / "deploy" / source_path).exists(), volume

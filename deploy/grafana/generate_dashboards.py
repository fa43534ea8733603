#!/usr/bin/env python3
"""Generates the onestream Grafana dashboards (deploy/grafana/dashboards/*.json).

    python deploy/grafana/generate_dashboards.py           # rewrite the JSON files
    python deploy/grafana/generate_dashboards.py --check   # fail if the checked-in files are stale

The JSON is checked in so that Grafana provisions or imports it as it is; edit this script, not the JSON.
Panel ids are unique by construction (one counter per dashboard) and every panel and template query reads
the `${datasource}` template variable, so a dashboard imports into any Grafana with a Prometheus source.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUTPUT_DIR = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
SCHEMA_VERSION = 39  # Grafana 10.4 / 11.x

# Label selectors: the card dashboards filter on the node and card template variables; the router's own
# series carry neither label, so router panels use no selector.
CARD = 'node=~"$node", gpu_uuid=~"$card"'
CARD_LEGEND = "{{node}} · GPU {{gpu_index}} ({{gpu_uuid}})"
QUANTILES = (0.5, 0.9, 0.99)

JSON = dict[str, Any]


@dataclass
class Query:
    expr: str
    legend: str = ""
    instant: bool = False  # tables and stats of current values
    table: bool = False


@dataclass
class Dashboard:
    """Lays panels out left to right in rows of GRID_WIDTH units, numbering them as they come."""

    uid: str
    title: str
    description: str
    panels: list[JSON] = field(default_factory=list)
    _next_id: int = 1
    _x: int = 0
    _y: int = 0
    _row_height: int = 0

    def _place(self, width: int, height: int) -> JSON:
        if self._x + width > GRID_WIDTH:
            self._new_line()
        pos = {"h": height, "w": width, "x": self._x, "y": self._y}
        self._x += width
        self._row_height = max(self._row_height, height)
        return pos

    def _new_line(self) -> None:
        self._y += self._row_height
        self._x = 0
        self._row_height = 0

    def _take_id(self) -> int:
        panel_id = self._next_id
        self._next_id += 1
        return panel_id

    def row(self, title: str) -> None:
        if self._x:
            self._new_line()
        self.panels.append(
            {
                "id": self._take_id(),
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": self._y},
                "panels": [],
            }
        )
        self._y += 1

    def panel(
        self,
        kind: str,
        title: str,
        description: str,
        queries: list[Query],
        *,
        unit: str = "short",
        width: int = 12,
        height: int = 8,
        minimum: float | None = 0,
        maximum: float | None = None,
        options: JSON | None = None,
        custom: JSON | None = None,
        transformations: list[JSON] | None = None,
    ) -> None:
        defaults: JSON = {"unit": unit}
        if minimum is not None:
            defaults["min"] = minimum
        if maximum is not None:
            defaults["max"] = maximum
        if custom is not None:
            defaults["custom"] = custom
        self.panels.append(
            {
                "id": self._take_id(),
                "type": kind,
                "title": title,
                "description": description,
                "datasource": DATASOURCE,
                "gridPos": self._place(width, height),
                "fieldConfig": {"defaults": defaults, "overrides": []},
                "options": options or {},
                "targets": [_target(q, chr(ord("A") + i)) for i, q in enumerate(queries)],
                **({"transformations": transformations} if transformations else {}),
            }
        )

    def timeseries(self, title: str, description: str, queries: list[Query], **kw: Any) -> None:
        custom = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": kw.pop("stacking", "none"), "group": "A"},
        }
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
        self.panel("timeseries", title, description, queries, custom=custom, options=options, **kw)

    def stat(self, title: str, description: str, query: Query, **kw: Any) -> None:
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        }
        kw.setdefault("width", 6)
        kw.setdefault("height", 5)
        self.panel("stat", title, description, [query], options=options, **kw)

    def to_json(self, templating: list[JSON], links: list[JSON]) -> JSON:
        return {
            "id": None,
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["onestream"],
            "timezone": "browser",
            "editable": True,
            "graphTooltip": 1,  # shared crosshair
            "schemaVersion": SCHEMA_VERSION,
            "version": 1,
            "refresh": "10s",
            "time": {"from": "now-1h", "to": "now"},
            "timepicker": {},
            "fiscalYearStartMonth": 0,
            "liveNow": False,
            "weekStart": "",
            "annotations": {
                "list": [
                    {
                        "builtIn": 1,
                        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                        "enable": True,
                        "hide": True,
                        "iconColor": "rgba(0, 211, 255, 1)",
                        "name": "Annotations & Alerts",
                        "type": "dashboard",
                    }
                ]
            },
            "links": links,
            "templating": {"list": templating},
            "panels": self.panels,
        }


def _target(query: Query, ref_id: str) -> JSON:
    target: JSON = {
        "refId": ref_id,
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": query.expr,
        "legendFormat": query.legend or "__auto",
        "range": not query.instant,
        "instant": query.instant,
    }
    if query.table:
        target["format"] = "table"
    return target


def _datasource_variable() -> JSON:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
    }


def _label_variable(name: str, label: str, title: str, metric_selector: str) -> JSON:
    definition = f"label_values({metric_selector}, {label})"
    return {
        "name": name,
        "label": title,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": definition,
        "query": {"qryType": 1, "query": definition, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "current": {},
        "hide": 0,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "options": [],
        "refresh": 2,  # on time range change: follows cards as they come and go
        "regex": "",
        "sort": 1,
    }


def _templating() -> list[JSON]:
    return [
        _datasource_variable(),
        _label_variable("node", "node", "Node", "onestream_card_info"),
        _label_variable("card", "gpu_uuid", "Card", 'onestream_card_info{node=~"$node"}'),
    ]


def _links() -> list[JSON]:
    return [
        {
            "title": "onestream",
            "type": "dashboards",
            "tags": ["onestream"],
            "asDropdown": False,
            "includeVars": True,
            "keepTime": True,
            "icon": "external link",
            "targetBlank": False,
            "tooltip": "",
            "url": "",
        }
    ]


def series(metric: str, selector: str) -> str:
    return f"{metric}{{{selector}}}" if selector else metric


def rate(metric: str, selector: str = CARD, by: str = "") -> str:
    """The summed per-second rate of a counter over Grafana's rate interval (at least 4 scrapes)."""
    grouping = f"sum by ({by}) " if by else "sum"
    return f"{grouping}(rate({series(metric, selector)}[$__rate_interval]))"


def quantile_queries(histogram: str, selector: str, by: str = "") -> list[Query]:
    grouping = f"le, {by}" if by else "le"
    legend_prefix = "{{" + by + "}} " if by else ""
    return [
        Query(
            f"histogram_quantile({q}, sum by ({grouping}) (rate({series(histogram + '_bucket', selector)}[$__rate_interval])))",
            f"{legend_prefix}p{round(q * 100)}",
        )
        for q in QUANTILES
    ]


def pool_overview() -> Dashboard:
    d = Dashboard(
        uid="onestream-pool",
        title="onestream / Pool overview",
        description="The whole pool: speed per card and in total, busy cards, the router's queue, sessions, rejections.",
    )
    by_card = "node, gpu_index, gpu_uuid"

    d.row("Throughput")
    d.stat(
        "Generated tok/s (pool)",
        "Tokens generated per second by the selected cards together.",
        Query(rate("onestream_generation_tokens_total")),
    )
    d.stat(
        "Busy cards",
        "Selected cards generating right now.",
        Query(f"sum(onestream_card_busy{{{CARD}}})"),
    )
    d.stat(
        "Cards in the pool",
        "Selected cards whose metrics Prometheus scrapes.",
        Query(f"count(onestream_card_info{{{CARD}}})"),
    )
    d.stat(
        "Queue depth",
        "Requests waiting for a free card at the router.",
        Query("sum(onestream_router_queue_depth)"),
    )
    d.timeseries(
        "Generated tok/s per card",
        "rate(onestream_generation_tokens_total): each card's decode speed, speculative gains included.",
        [Query(rate("onestream_generation_tokens_total", by=by_card), CARD_LEGEND)],
        unit="short",
    )
    d.timeseries(
        "Generated tok/s, total",
        "The pool's output, stacked by node.",
        [Query(rate("onestream_generation_tokens_total", by="node"), "{{node}}")],
        stacking="normal",
    )

    d.row("Cards")
    d.timeseries(
        "Cards by state (router)",
        "The router's view: free, busy, or down (dead or unreachable, waiting to rejoin).",
        [Query("sum by (state) (onestream_router_cards)", "{{state}}")],
        stacking="normal",
    )
    d.timeseries(
        "Busy per card",
        "1 while the card generates. A card busy for long without tokens is stuck.",
        [Query(f"max by ({by_card}) (onestream_card_busy{{{CARD}}})", CARD_LEGEND)],
        maximum=1,
    )

    d.row("Queue")
    d.timeseries(
        "Queue depth",
        "Requests waiting for a card: all cards busy, or a session waiting for its home card.",
        [Query("sum(onestream_router_queue_depth)", "waiting")],
    )
    d.timeseries(
        "Queue wait",
        "Time from a request's arrival at the router to a card starting it.",
        quantile_queries("onestream_request_queue_time_seconds", ""),
        unit="s",
    )
    d.timeseries(
        "Rejections by reason",
        "Requests refused: queue_full (RESOURCE_EXHAUSTED), invalid_argument, deadline, draining, no_cards.",
        [Query(rate("onestream_router_rejections_total", "", by="reason"), "{{reason}}")],
        unit="reqps",
    )
    d.timeseries(
        "Finished requests by reason",
        "Generations ending per second on the selected cards: stop, length, cancelled, error.",
        [Query(rate("onestream_requests_total", by="finish_reason"), "{{finish_reason}}")],
        unit="reqps",
    )

    d.row("Sessions")
    d.timeseries(
        "Sessions",
        "Sessions bound to a home card at the router, and sessions whose state the selected cards hold.",
        [
            Query("sum(onestream_router_sessions)", "bound at the router"),
            Query(f"sum(onestream_cached_sessions{{{CARD}}})", "cached on cards"),
        ],
    )
    d.timeseries(
        "Session affinity",
        "Turns served by the session's home card, and turns placed elsewhere (by reason).",
        [
            Query(rate("onestream_router_affinity_hits_total", ""), "home card"),
            Query(rate("onestream_router_affinity_misses_total", "", by="reason"), "moved: {{reason}}"),
        ],
        unit="reqps",
    )
    d.timeseries(
        "Prompt tokens served from cache",
        "Share of prompt tokens a card already held for the session (no prefill needed).",
        [
            Query(
                f"{rate('onestream_cached_prompt_tokens_total')} / {rate('onestream_prompt_tokens_total')}",
                "cached share",
            )
        ],
        unit="percentunit",
        maximum=1,
    )
    d.timeseries(
        "Prefix routing",
        "Turns without a home card (new sessions, requests without a session id) placed on a card holding "
        "a prefix of their prompt, and those placed elsewhere (by reason).",
        [
            Query(rate("onestream_router_prefix_hits_total", ""), "on a card holding a prefix"),
            Query(rate("onestream_router_prefix_misses_total", "", by="reason"), "missed: {{reason}}"),
        ],
        unit="reqps",
    )
    d.timeseries(
        "Prefix cache hits",
        "Turns whose prompt state a card found by its prefix (a shared prefix, or the conversation's earlier "
        "turn), and the prompt tokens they did not prefill.",
        [
            Query(rate("onestream_prefix_cache_hits_total"), "turns"),
            Query(rate("onestream_prefix_cache_tokens_saved_total"), "tokens saved"),
        ],
    )

    d.row("Users")
    per_user = (
        " Labelled by user only when the router runs with --metrics-per-user; otherwise one series sums "
        "over all users."
    )
    d.timeseries(
        "Requests per user",
        "Generate calls of authenticated callers (both doors: gRPC and HTTP)." + per_user,
        [Query(rate("onestream_router_user_requests_total", "", by="user"), "{{user}}")],
        unit="reqps",
    )
    d.timeseries(
        "Tokens per user",
        "Prompt tokens of finished requests and tokens streamed back, per second." + per_user,
        [
            Query(rate("onestream_router_user_prompt_tokens_total", "", by="user"), "{{user}} prompt"),
            Query(rate("onestream_router_user_generation_tokens_total", "", by="user"), "{{user}} generated"),
        ],
    )
    d.timeseries(
        "Rejections per user",
        "Requests of authenticated callers refused before a card, by reason (user_concurrent and "
        "user_queued: over the --user-max-* limits, answered 429 / RESOURCE_EXHAUSTED)." + per_user,
        [
            Query(
                rate("onestream_router_user_rejections_total", "", by="user, reason"),
                "{{user}} {{reason}}",
            )
        ],
        unit="reqps",
    )

    d.row("Speculative decoding")
    d.timeseries(
        "Draft acceptance rate",
        "Accepted drafted tokens / drafted tokens, over the selected cards.",
        [
            Query(
                f"{rate('onestream_spec_decode_num_accepted_tokens_total')}"
                f" / {rate('onestream_spec_decode_num_draft_tokens_total')}",
                "acceptance rate",
            )
        ],
        unit="percentunit",
        maximum=1,
    )
    d.timeseries(
        "Mean accepted length",
        "Tokens gained per verify cycle over the selected cards: 1 + accepted drafts / cycles.",
        [
            Query(
                f"1 + {rate('onestream_spec_decode_num_accepted_tokens_total')}"
                f" / {rate('onestream_spec_decode_num_drafts_total')}",
                "mean accepted length",
            )
        ],
    )
    d.timeseries(
        "Accepted draft tokens by source",
        "Drafted tokens the target accepted, per second, by where the drafts came from: the MTP head, or "
        "copies from the session's own context (prompt lookup). What each source saves the selected cards.",
        [Query(rate("onestream_spec_decode_num_accepted_tokens_total", by="source"), "{{source}}")],
        unit="short",
    )
    d.timeseries(
        "Mean accepted length by source",
        "Tokens gained per verify cycle, for the cycles that verified drafts of each source.",
        [
            Query(
                f"1 + {rate('onestream_spec_decode_num_accepted_tokens_total', by='source')}"
                f" / {rate('onestream_spec_decode_num_drafts_total', by='source')}",
                "{{source}}",
            )
        ],
    )
    return d


def per_card() -> Dashboard:
    d = Dashboard(
        uid="onestream-card",
        title="onestream / Per card",
        description="One card (or the selected cards): speed, speculative acceptance, latency, prefill and cache.",
    )
    by_card = "node, gpu_index, gpu_uuid"

    d.row("Identity")
    d.panel(
        "table",
        "Cards",
        "The selected cards: where they run, their back end and device.",
        [Query(f"onestream_card_info{{{CARD}}}", instant=True, table=True)],
        width=24,
        height=5,
        minimum=None,
        options={"showHeader": True, "cellHeight": "sm"},
        transformations=[
            {
                "id": "organize",
                "options": {
                    "excludeByName": {
                        "Time": True,
                        "Value": True,
                        "__name__": True,
                        "job": True,
                        "role": True,
                    },
                    "indexByName": {},
                    "renameByName": {},
                },
            }
        ],
    )

    d.row("Speed")
    d.timeseries(
        "Generated tok/s",
        "rate(onestream_generation_tokens_total) per card.",
        [Query(rate("onestream_generation_tokens_total", by=by_card), CARD_LEGEND)],
    )
    d.timeseries(
        "Busy",
        "1 while the card generates.",
        [Query(f"max by ({by_card}) (onestream_card_busy{{{CARD}}})", CARD_LEGEND)],
        maximum=1,
    )

    d.row("Speculative decoding")
    d.timeseries(
        "Acceptance rate",
        "Accepted drafted tokens / drafted tokens.",
        [
            Query(
                f"{rate('onestream_spec_decode_num_accepted_tokens_total', by=by_card)}"
                f" / {rate('onestream_spec_decode_num_draft_tokens_total', by=by_card)}",
                CARD_LEGEND,
            )
        ],
        unit="percentunit",
        maximum=1,
        width=8,
    )
    d.timeseries(
        "Acceptance per draft position",
        "Share of verify cycles whose draft at this position (0 = first) was accepted.",
        [
            Query(
                f"{rate('onestream_spec_decode_num_accepted_tokens_per_pos_total', by='position')}"
                f" / ignoring (position) group_left () {rate('onestream_spec_decode_num_drafts_total')}",
                "position {{position}}",
            )
        ],
        unit="percentunit",
        maximum=1,
        width=8,
    )
    d.timeseries(
        "Mean accepted length",
        "Tokens gained per verify cycle: 1 + accepted drafts / cycles.",
        [
            Query(
                f"1 + {rate('onestream_spec_decode_num_accepted_tokens_total', by=by_card)}"
                f" / {rate('onestream_spec_decode_num_drafts_total', by=by_card)}",
                CARD_LEGEND,
            )
        ],
        width=8,
    )
    d.timeseries(
        "Draft vocabulary",
        "Token ids greedy MTP drafts choose among (the first ones): a draft step reads only those rows of the "
        "lm_head. The vocabulary's size until the card has learnt a shorter prefix from its output.",
        [Query(f"max by ({by_card}) (onestream_draft_vocab_rows{{{CARD}}})", CARD_LEGEND)],
        width=8,
    )

    d.row("Latency")
    d.timeseries(
        "Time to first token",
        "From the request starting on the card to its first token (prefill included).",
        quantile_queries("onestream_time_to_first_token_seconds", CARD),
        unit="s",
        width=8,
    )
    d.timeseries(
        "Inter-token latency",
        "Between streamed tokens (speculative cycles stream several at once).",
        quantile_queries("onestream_inter_token_latency_seconds", CARD),
        unit="s",
        width=8,
    )
    d.timeseries(
        "Request latency",
        "Whole request on the card, first prompt token to last generated token.",
        quantile_queries("onestream_e2e_request_latency_seconds", CARD),
        unit="s",
        width=8,
    )

    d.row("Prefill and cache")
    d.timeseries(
        "Prompt tokens",
        "Prompt tokens received, served from the session cache, and actually computed (prefill); tokens decoded.",
        [
            Query(rate("onestream_prompt_tokens_total"), "prompt"),
            Query(rate("onestream_cached_prompt_tokens_total"), "from cache"),
            Query(rate("onestream_prefill_tokens_total"), "prefilled"),
            Query(rate("onestream_generation_tokens_total"), "decoded"),
        ],
        width=8,
    )
    d.timeseries(
        "Cache hit share",
        "Share of prompt tokens served from the card's session cache.",
        [
            Query(
                f"{rate('onestream_cached_prompt_tokens_total', by=by_card)}"
                f" / {rate('onestream_prompt_tokens_total', by=by_card)}",
                CARD_LEGEND,
            )
        ],
        unit="percentunit",
        maximum=1,
        width=8,
    )
    d.timeseries(
        "Cached sessions",
        "Sessions whose state the card holds for their next turn.",
        [Query(f"sum by ({by_card}) (onestream_cached_sessions{{{CARD}}})", CARD_LEGEND)],
        width=8,
    )
    d.timeseries(
        "Cached session memory",
        "Memory the cached sessions hold (KV caches, DeltaNet states).",
        [Query(f"sum by ({by_card}) (onestream_cached_session_bytes{{{CARD}}})", CARD_LEGEND)],
        unit="bytes",
    )
    d.timeseries(
        "Shared prefix checkpoints",
        "Memory of the prefix checkpoints the card shares across sessions (part of its session cache budget), "
        "and the prompt tokens they and requests without a session id saved.",
        [
            Query(
                f"sum by ({by_card}) (onestream_prefix_checkpoint_bytes{{{CARD}}})", f"{CARD_LEGEND} bytes"
            ),
            Query(
                f"sum by ({by_card}) (rate(onestream_prefix_cache_tokens_saved_total{{{CARD}}}[$__rate_interval]))",
                f"{CARD_LEGEND} tokens saved/s",
            ),
        ],
    )
    d.timeseries(
        "Finished requests by reason",
        "Generations ending per second.",
        [Query(rate("onestream_requests_total", by="finish_reason"), "{{finish_reason}}")],
        unit="reqps",
    )
    return d


def build() -> dict[str, JSON]:
    """File name -> dashboard JSON, for every dashboard."""
    return {f"{d.uid}.json": d.to_json(_templating(), _links()) for d in (pool_overview(), per_card())}


def render(dashboard: JSON) -> str:
    return json.dumps(dashboard, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a checked-in dashboard is stale")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    args = parser.parse_args(argv)
    stale = []
    for name, dashboard in build().items():
        path = args.output_dir / name
        text = render(dashboard)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale (run deploy/grafana/generate_dashboards.py):", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

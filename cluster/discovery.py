"""Prometheus HTTP service discovery (`http_sd_configs`) of the router and every live card.

GET http://ROUTER_METRICS_ADDR/sd returns target groups: the router's own /metrics endpoint (label
`role="router"`) and one group per live card (`role="card"`). Cards carry their identity as
`__meta_onestream_*` labels for relabelling; their series already have `node`, `gpu_index`, `gpu_uuid`
and `model` labels, so a plain scrape config needs no relabelling. One scrape config thus follows cards
on every box as they come and go.
"""

from __future__ import annotations

from typing import Any


def service_discovery_groups(router_endpoint: str, card_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    router = {"targets": [router_endpoint], "labels": {"role": "router"}}
    return [router, *card_groups]

"""`onestream status`: the pool's cards, sessions and queue, as the router sees them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: Any) -> None:
    from onestream.cluster.client import add_connection_arguments

    p = subparsers.add_parser("status", help="show the pool's cards, sessions and queue", description=__doc__)
    add_connection_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from onestream.cluster.client import client_from_args

    with client_from_args(args) as client:
        try:
            status = client.pool_status()
            cards = client.cards()
            sessions = client.sessions()
            health = client.health()
        except grpc.RpcError as e:
            print(f"onestream status: {args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        try:
            model = client.model_info()
        except grpc.RpcError:  # no card has come up yet
            model = None
    if args.json:
        report = {
            "health": health,
            "model": MessageToDict(model, always_print_fields_with_no_presence=True) if model else None,
            "pool": MessageToDict(status, always_print_fields_with_no_presence=True),
            "cards": [MessageToDict(c, always_print_fields_with_no_presence=True) for c in cards],
            "sessions": [MessageToDict(s, always_print_fields_with_no_presence=True) for s in sessions],
        }
        print(json.dumps(report, indent=1))
        return 0
    print(format_status(args.server, health, status, cards, sessions, model))
    return 0


def format_status(
    server: str, health: str, status: Any, cards: list[Any], sessions: list[Any], model: Any = None
) -> str:
    from onestream.protos.onestream.v1 import onestream_pb2 as pb

    lines = [
        f"pool at {server}: {health}{' (draining)' if status.draining else ''}",
        f"  model {model.name} [{model.format or 'unknown format'}] on {model.backend} {model.dtype}"
        if model is not None
        else "  model: no card is up yet",
        f"  queue {status.queue_depth}/{status.queue_capacity}   in flight {status.in_flight}   "
        f"cards free {status.cards_free} busy {status.cards_busy} down {status.cards_down} "
        f"starting {status.cards_starting}   sessions {status.sessions}",
        "",
    ]
    rows = [("CARD", "STATE", "DEVICE", "BACKEND", "SESSIONS", "CACHE MiB", "RESTARTS", "METRICS")]
    for c in cards:
        state = pb.CardState.Name(c.state).removeprefix("CARD_STATE_").lower()
        if c.state == pb.CARD_STATE_LOADING:
            state += f" {c.loading_fraction * 100:.0f}%"
        rows.append(
            (
                c.card_id,
                state,
                c.device_name,
                c.backend,
                str(c.cached_sessions),
                f"{c.cached_session_bytes / 2**20:.1f}",
                str(c.restarts),
                c.metrics_endpoint,
            )
        )
    lines += _table(rows)
    if sessions:
        lines.append("")
        # USER: the session's owner (`-` in a pool without API keys); an admin key sees everyone's.
        rows = [("SESSION", "USER", "CARD", "TURNS", "CACHED TOKENS", "CACHE MiB")]
        for s in sessions:
            rows.append(
                (
                    s.session_id,
                    s.user or "-",
                    s.card_id,
                    str(s.turns),
                    str(s.cached_tokens),
                    f"{s.cached_bytes / 2**20:.1f}",
                )
            )
        lines += _table(rows)
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]

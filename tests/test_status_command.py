"""`onestream status`'s tables, from the router's messages (the command against a real pool: test_pool.py)."""

from __future__ import annotations

from onestream.protos.onestream.v1 import onestream_pb2 as pb

from onestream.commands.status import format_status


def test_sessions_show_their_owner() -> None:
    sessions = [
        pb.Session(session_id="alice-notes", user="alice", card_id="card-0", turns=3, cached_tokens=120),
        pb.Session(session_id="one-off", card_id="card-1", turns=1),
    ]
    out = format_status("127.0.0.1:50051", "SERVING", pb.PoolStatus(), [], sessions).splitlines()
    header = next(line for line in out if line.startswith("SESSION"))
    assert header.split()[:3] == ["SESSION", "USER", "CARD"]
    rows = {line.split()[0]: line.split() for line in out if line.startswith(("alice-notes", "one-off"))}
    assert rows["alice-notes"][1:4] == ["alice", "card-0", "3"]
    assert rows["one-off"][1] == "-"  # a pool without API keys has no users

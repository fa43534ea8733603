"""API keys, callers, session owners and the loopback rule (cluster/auth.py, `serve`'s checks), no Ray."""

from __future__ import annotations

import argparse
import logging
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from onestream.cluster.auth import (
    ANONYMOUS,
    ApiKeys,
    Authenticator,
    AuthError,
    Caller,
    KeyFileError,
    SessionOwners,
    exposure_error,
    is_loopback,
)

from onestream.commands.serve import users_problem


def new_key() -> str:
    return secrets.token_urlsafe(24)


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def test_the_key_file_maps_keys_to_users_and_marks_admins() -> None:
    alice, alice2, root = new_key(), new_key(), new_key()
    keys = ApiKeys.parse(f"# team keys\n\n{alice} alice\n{alice2}   alice\n{root} ops admin\n")
    assert len(keys) == 3 and keys.users == {"alice", "ops"}
    assert keys.lookup(alice) == keys.lookup(alice2) == Caller("alice", admin=False)
    assert keys.lookup(root) == Caller("ops", admin=True)
    assert keys.lookup(new_key()) is None
    assert keys.lookup(alice[:-1]) is None and keys.lookup(alice + "x") is None
    assert keys.lookup("") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "holds no keys"),
        ("# only a comment\n", "holds no keys"),
        ("KEYKEYKEYKEYKEYKEY\n", r"line 1: expected `KEY USER`"),
        ("KEYKEYKEYKEYKEYKEY alice root\n", r"line 1: expected `KEY USER` or `KEY USER admin`"),
        ("KEYKEYKEYKEYKEYKEY alice admin extra\n", "line 1: expected"),
        ("\nk3y alice\n", "line 2: the key is shorter than 16 characters"),
        ("KEYKEYKEYKEYKEYKEY al/ice\n", "line 1: user 'al/ice' must be"),
        (
            "KEYKEYKEYKEYKEYKEY alice\nKEYKEYKEYKEYKEYKEY bob\n",
            "line 2: the same key appears on an earlier line",
        ),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_line_and_never_the_key(text: str, message: str) -> None:
    with pytest.raises(KeyFileError, match=message) as refused:
        ApiKeys.parse(text, "keys.txt")
    assert "KEYKEYKEY" not in str(refused.value) and "k3y" not in str(refused.value)


def test_an_unreadable_key_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match=r"cannot read the key file .*missing"):
        ApiKeys.load(tmp_path / "missing")
    (tmp_path / "binary").write_bytes(b"\xff\xfe" * 20)
    with pytest.raises(KeyFileError, match="not UTF-8"):
        ApiKeys.load(tmp_path / "binary")


def test_callers_are_told_what_is_missing_without_seeing_the_key(tmp_path: Path) -> None:
    key = new_key()
    path = tmp_path / "keys"
    path.write_text(f"{key} alice\n")
    auth = Authenticator(str(path))
    assert auth.enabled
    assert auth.caller(bearer(key)) == Caller("alice")
    assert auth.caller([("authorization", f"bearer  {key} ")]) == Caller("alice")  # case, spaces
    with pytest.raises(AuthError, match="needs an API key: send the metadata `authorization: Bearer KEY`"):
        auth.caller([("user-agent", "grpc-python")])
    with pytest.raises(AuthError, match="must be `Bearer KEY`"):
        auth.caller([("authorization", f"Basic {key}")])
    wrong = new_key()
    with pytest.raises(AuthError, match="not valid") as refused:
        auth.caller(bearer(wrong))
    assert wrong not in str(refused.value)
    assert Authenticator(None).caller([]) is ANONYMOUS and not Authenticator(None).enabled


def test_reloading_swaps_the_keys_and_a_bad_file_keeps_the_old_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    alice, bob = new_key(), new_key()
    path = tmp_path / "keys"
    path.write_text(f"{alice} alice\n")
    auth = Authenticator(str(path))
    path.write_text(f"{bob} bob\n")
    assert auth.reload()
    assert auth.caller(bearer(bob)).user == "bob"
    with pytest.raises(AuthError):
        auth.caller(bearer(alice))
    path.write_text(f"{alice} alice\nnot a key line at all\n")
    with caplog.at_level(logging.ERROR, logger="onestream.cluster.auth"):
        assert not auth.reload()
    assert "keeping the 1 keys in force" in caplog.text and "line 2" in caplog.text
    assert auth.caller(bearer(bob)).user == "bob"
    path.unlink()
    assert not auth.reload() and auth.caller(bearer(bob)).user == "bob"


def test_a_session_belongs_to_the_user_who_opened_it_until_it_expires() -> None:
    now = [0.0]
    owners = SessionOwners(ttl_s=100.0, clock=lambda: now[0])
    alice, bob, admin = Caller("alice"), Caller("bob"), Caller("ops", admin=True)
    assert owners.claim("s", alice) is None
    assert owners.claim("s", bob) == "alice"
    assert owners.claim("s", alice) is None  # a later turn renews it
    assert owners.visible_to(alice, "s") and owners.visible_to(admin, "s") and not owners.visible_to(bob, "s")
    assert alice.may_act_for("alice") and admin.may_act_for("alice") and not bob.may_act_for("alice")
    now[0] = 99.0
    assert owners.owner_of("s") == "alice"
    now[0] = 201.0
    assert owners.owner_of("s") is None and owners.claim("s", bob) is None
    assert owners.claim("anon", ANONYMOUS) is None and owners.owner_of("anon") is None
    owners.forget("s")
    assert owners.owner_of("s") is None
    now[0] = 1000.0
    owners.claim("t", alice)
    assert len(owners) == 1, "expired owners are swept"


def test_owners_reported_by_adopted_cards_are_kept_from_their_last_turn() -> None:
    now = [1000.0]
    owners = SessionOwners(ttl_s=100.0, clock=lambda: now[0])
    alice, bob = Caller("alice"), Caller("bob")
    owners.adopt("s", "alice", time.time() - 40.0)  # a card cached alice's turn 40 s ago
    assert owners.owner_of("s") == "alice" and owners.claim("s", bob) == "alice"
    now[0] += 59.0
    assert owners.owner_of("s") == "alice"
    now[0] += 2.0  # 101 s after that turn: as if this router had seen it
    assert owners.owner_of("s") is None
    assert owners.claim("t", bob) is None
    owners.adopt("t", "alice", 0.0)  # an owner known here stays
    assert owners.owner_of("t") == "bob" and owners.claim("t", alice) == "bob"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("", False),
        ("::", False),
        ("10.1.2.3", False),
        ("no-such-host.invalid", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_listening_beyond_loopback_needs_keys_or_insecure() -> None:
    exposed = {"--listen": "0.0.0.0:50051", "--http": "127.0.0.1:8000"}
    message = exposure_error(exposed, keys=False, insecure=False)
    assert message is not None and "--listen 0.0.0.0:50051" in message and "--http" not in message
    assert "--api-keys FILE" in message and "--insecure" in message
    assert exposure_error(exposed, keys=True, insecure=False) is None
    assert exposure_error(exposed, keys=False, insecure=True) is None
    assert (
        exposure_error({"--listen": "[::1]:1", "--http": "localhost:8000"}, keys=False, insecure=False)
        is None
    )


def serve_args(**changes: object) -> argparse.Namespace:
    values = dict(
        listen="127.0.0.1:50051",
        http="127.0.0.1:8000",
        api_keys=None,
        insecure=False,
        user_max_concurrent=None,
        user_max_queued=None,
        metrics_per_user=False,
    )
    return argparse.Namespace(**(values | changes))


def test_serve_checks_the_user_flags_before_starting_anything(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{new_key()} alice\n")
    assert users_problem(serve_args()) is None
    assert "--listen 0.0.0.0:50051" in (users_problem(serve_args(listen="0.0.0.0:50051")) or "")
    assert users_problem(serve_args(listen="0.0.0.0:50051", insecure=True)) is None
    assert "--http 0.0.0.0:8000 listens beyond" in (users_problem(serve_args(http="0.0.0.0:8000")) or "")
    assert users_problem(serve_args(http="off")) is None
    assert users_problem(serve_args(listen="0.0.0.0:50051", api_keys=str(keys))) is None
    assert users_problem(serve_args(user_max_queued=2, metrics_per_user=True)) == (
        "--user-max-queued, --metrics-per-user needs --api-keys: without keys there are no users"
    )
    assert users_problem(serve_args(api_keys=str(keys), user_max_concurrent=0)) == (
        "--user-max-concurrent must be >= 1, got 0"
    )
    assert "cannot read the key file" in (users_problem(serve_args(api_keys=str(tmp_path / "nope"))) or "")


def test_serve_refuses_to_listen_beyond_loopback_without_keys() -> None:
    """The real command: it refuses before starting Ray or loading a model."""
    result = subprocess.run(
        [sys.executable, "-m", "onestream", "serve", "--listen", "0.0.0.0:0", "--cpu-cards", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "onestream serve: --listen 0.0.0.0:0 listens beyond this machine without API keys" in result.stderr
    assert "Traceback" not in result.stderr and "Ray" not in result.stdout

"""Who is calling: API keys, users, the admin mark, and the rule that an exposed pool needs keys.

The key file (`onestream serve --api-keys FILE`) has one key per line: `KEY USER`, or `KEY USER admin`
for a key whose holder sees and may close or abort every user's sessions; blank lines and lines starting
with `#` are ignored. A user may hold several keys. Only SHA-256 digests of the keys are kept in memory,
and a presented key is compared with every digest in constant time (`hmac.compare_digest`), so neither
the timing nor a memory dump gives a key away. SIGHUP re-reads the file; a file that does not parse
keeps the keys in force and the reason is logged.

gRPC callers send the key as call metadata `authorization: Bearer KEY`; the HTTP front door turns an
HTTP request's `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY` into that metadata
(`frontdoor/upstream.py`), so both doors are checked here alike. Without a key file the pool has no users: every caller is `ANONYMOUS`, which
may do anything, and `check_exposure` lets that happen only on loopback addresses.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"  # gRPC metadata keys are lower case
BEARER = "bearer "
# Trailing metadata of a RESOURCE_EXHAUSTED status: whole seconds after which a retry may succeed (the
# HTTP front door sends it as `Retry-After`, frontdoor/errors.py).
RETRY_AFTER = "retry-after-s"
ADMIN_MARK = "admin"
MIN_KEY_CHARS = 16
USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")  # also a metric label value


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file and line."""


class AuthError(Exception):
    """The call carries no key or an unknown one (UNAUTHENTICATED); the message never holds the key."""


@dataclass(frozen=True)
class Caller:
    user: str | None  # None: the pool runs without keys
    admin: bool = False

    def may_act_for(self, owner: str | None) -> bool:
        """May this caller close or abort what `owner` started?"""
        return self.admin or owner == self.user


ANONYMOUS = Caller(user=None, admin=True)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The parsed key file: key digests and the caller each one stands for."""

    def __init__(self, entries: Sequence[tuple[bytes, Caller]]) -> None:
        self._entries = list(entries)

    @classmethod
    def parse(cls, text: str, source: str = "the key file") -> ApiKeys:
        entries: list[tuple[bytes, Caller]] = []
        seen: set[bytes] = set()
        for number, line in enumerate(text.splitlines(), start=1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            where = f"{source} line {number}"
            if len(fields) not in (2, 3) or (len(fields) == 3 and fields[2] != ADMIN_MARK):
                raise KeyFileError(
                    f"{where}: expected `KEY USER` or `KEY USER {ADMIN_MARK}`, got {len(fields)} fields"
                )
            key, user = fields[0], fields[1]
            if len(key) < MIN_KEY_CHARS:
                raise KeyFileError(f"{where}: the key is shorter than {MIN_KEY_CHARS} characters")
            if not USER_NAME.fullmatch(user):
                raise KeyFileError(
                    f"{where}: user {user!r} must be 1-64 characters of letters, digits and ._@- "
                    "(starting with a letter or digit)"
                )
            digest = _digest(key)
            if digest in seen:
                raise KeyFileError(f"{where}: the same key appears on an earlier line")
            seen.add(digest)
            entries.append((digest, Caller(user=user, admin=len(fields) == 3)))
        if not entries:
            raise KeyFileError(f"{source} holds no keys")
        return cls(entries)

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise KeyFileError(f"cannot read the key file {path}: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise KeyFileError(f"the key file {path} is not UTF-8 text") from e
        return cls.parse(text, str(path))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def users(self) -> set[str]:
        return {caller.user for _, caller in self._entries if caller.user is not None}

    def lookup(self, key: str) -> Caller | None:
        """The caller `key` belongs to; every entry is compared, whatever matches, in constant time."""
        digest = _digest(key)
        found = None
        for stored, caller in self._entries:
            if hmac.compare_digest(stored, digest):
                found = caller
        return found


class Authenticator:
    """The keys in force for a router (None: no keys, every caller is ANONYMOUS), re-readable."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._keys = ApiKeys.load(path) if path else None  # a bad file at start-up stops the start

    @property
    def enabled(self) -> bool:
        return self._keys is not None

    @property
    def keys(self) -> ApiKeys | None:
        return self._keys

    def reload(self) -> bool:
        """Re-read the key file (SIGHUP). A file that does not parse keeps the keys in force; the
        reason is logged. Calls already admitted are not affected either way."""
        if not self.path:
            log.info("no --api-keys file to re-read")
            return False
        try:
            keys = ApiKeys.load(self.path)
        except KeyFileError as e:
            log.error("keeping the %d keys in force: %s", len(self._keys or ()), e)
            return False
        self._keys = keys
        log.info("re-read %s: %d keys of %d users", self.path, len(keys), len(keys.users))
        return True

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Caller:
        """Who sent a call with this metadata; raises AuthError when keys are on and it has none that
        is known."""
        if self._keys is None:
            return ANONYMOUS
        values = [v for k, v in metadata or () if k == AUTHORIZATION]
        if not values:
            raise AuthError(
                "this pool needs an API key: send the metadata `authorization: Bearer KEY` "
                "(HTTP: `Authorization: Bearer KEY` or `x-api-key: KEY`)"
            )
        value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        if value[: len(BEARER)].lower() != BEARER:
            raise AuthError("the authorization metadata must be `Bearer KEY`")
        caller = self._keys.lookup(value[len(BEARER) :].strip())
        if caller is None:
            raise AuthError("the API key is not valid (unknown, or removed from the key file)")
        return caller


class SessionOwners:
    """The user who opened each session: another user's turn on it is refused, and so are their
    CloseSession and listings of it (an admin may close any). An owner is kept while the session could
    still be cached on some card: until CloseSession, or `ttl_s` after its last turn. Anonymous callers
    (no keys) own nothing. The cards keep each cached session's owner too, so a restarted router adopts
    them with the cards (`adopt`)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._owners: dict[str, tuple[str, float]] = {}  # session id -> (user, last turn, monotonic)
        self._swept = clock()

    def __len__(self) -> int:
        return len(self._owners)

    def claim(self, session_id: str, caller: Caller) -> str | None:
        """A turn of `caller` on `session_id`: None when it may go ahead (the session is now the caller's,
        if it was nobody's), else the user who owns it."""
        if caller.user is None:
            return None
        self._sweep()
        owner = self.owner_of(session_id)
        if owner is not None and owner != caller.user:
            return owner
        self._owners[session_id] = (caller.user, self._clock())
        return None

    def owner_of(self, session_id: str) -> str | None:
        entry = self._owners.get(session_id)
        if entry is None or entry[1] < self._clock() - self.ttl_s:
            return None
        return entry[0]

    def adopt(self, session_id: str, user: str, last_used_wall: float) -> None:
        """The owner a card reports for a session it caches (a restarted router learns them from its
        cards): `user` owns it from its last turn (unix seconds; 0: now), unless an owner is known here."""
        if self.owner_of(session_id) is not None:
            return
        idle_s = max(time.time() - last_used_wall, 0.0) if last_used_wall else 0.0
        self._owners[session_id] = (user, self._clock() - idle_s)

    def visible_to(self, caller: Caller, session_id: str) -> bool:
        return caller.admin or self.owner_of(session_id) == caller.user

    def forget(self, session_id: str) -> None:
        self._owners.pop(session_id, None)

    def _sweep(self) -> None:
        now = self._clock()
        if now - self._swept < min(self.ttl_s, 60.0):
            return
        self._swept = now
        horizon = now - self.ttl_s
        self._owners = {k: v for k, v in self._owners.items() if v[1] >= horizon}


# ---- the loopback rule ----------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """True when `host` (an address or a name) reaches only this machine. An unresolvable name counts
    as exposed."""
    host = host.strip("[]")
    if not host:
        return False  # an empty host binds every interface
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def exposure_error(listeners: Mapping[str, str], *, keys: bool, insecure: bool) -> str | None:
    """Why `serve` must not start, or None. `listeners` maps a flag (e.g. `--listen`) to its HOST:PORT;
    a listener off loopback needs --api-keys, or --insecure to say that the network is trusted."""
    if keys or insecure:
        return None
    exposed = [f"{flag} {address}" for flag, address in listeners.items() if not is_loopback(_host(address))]
    if not exposed:
        return None
    return (
        f"{', '.join(exposed)} listens beyond this machine without API keys: anyone who can reach it "
        "could use the pool. Give --api-keys FILE (lines of `KEY USER`), or --insecure if the network "
        "is trusted"
    )


def _host(address: str) -> str:
    host, _, _ = address.rpartition(":")
    return host

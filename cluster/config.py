"""Settings of a pool: where it listens, how cards are placed, and every timeout of the router."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onestream.worker.prefixes import DEFAULT_PREFIX_SHARING

if TYPE_CHECKING:
    from .engine_source import EngineSource


@dataclass
class PoolConfig:
    model_dir: str
    grpc_address: str = "127.0.0.1:50051"  # port 0 picks a free port
    metrics_address: str = "127.0.0.1:9400"  # the router's /metrics and /sd; port 0 picks a free port
    http_address: str | None = None  # the HTTP front door (OpenAI / Anthropic APIs); None: off
    http_max_body_bytes: int = 64 << 20  # larger request bodies get 413
    http_user_sessions: bool = False  # a request's `user` field pins its session (docs/http.md)
    http_keepalive_s: float = 15.0  # a quiet event stream gets a comment line this often (frontdoor/sse.py)
    # Cards: one per GPU of every node; or, with `cpu_cards`, CPU engines where nodes advertise the
    # `onestream_cpu_card` resource (a locally started Ray node advertises `cpu_cards` of them).
    cpu_cards: int | None = None
    backend: str = "auto"
    dtype: str | None = None
    card_torch_threads: int | None = None
    card_metrics_host: str | None = None  # None: each node's IP address
    engine_options: dict[str, Any] = field(default_factory=dict)
    # What builds the cards' engines (cluster/engine_source.py: a random 27B-shaped model for a benchmark,
    # say); None: the checkpoint at `model_dir`, whose tokenizer the router routes text prompts with anyway.
    engine_source: EngineSource | None = None
    max_restarts: int = 3  # Ray restarts of a dead card actor before it is recreated from scratch
    ray_namespace: str = "onestream"
    # Scheduling (cluster/policy.py).
    queue_capacity: int = 256
    home_wait_s: float = 2.0
    session_ttl_s: float = 6 * 3600.0
    prefix_sharing: str = DEFAULT_PREFIX_SHARING  # who shares prompt-prefix state: "user" or "team"
    queue_timeout_s: float = 600.0  # longest a request waits for a card without its own deadline
    retries_before_first_token: int = 1  # a card that fails before sending a token: retry elsewhere
    # Users (cluster/auth.py): without a key file every caller is anonymous and no per-user rule applies.
    api_keys_path: str | None = None
    user_max_concurrent: int | None = None  # a user's requests in flight (queued or generating)
    user_max_queued: int | None = None  # of those, waiting for a card
    retry_after_s: int = 2  # the hint sent with RESOURCE_EXHAUSTED (trailing metadata `retry-after-s`)
    metrics_per_user: bool = False  # label the per-user counters with `user` (one series set per user)
    # Timeouts of calls to card actors.
    call_timeout_s: float = 10.0  # ping, listings, close_session
    card_start_timeout_s: float = 900.0  # actor start and model load
    first_token_timeout_s: float = 600.0  # a long prompt's prefill on a slow card
    token_timeout_s: float = 60.0  # between two items of a stream; longer is a hung card
    # Liveness: every card is pinged every `health_interval_s`; one that does not answer within
    # `stall_timeout_s`, or whose busy engine makes no progress (prefill chunks, decode steps) for that
    # long, is down (a hung card is then killed so that Ray restarts it). The two add up to the worst case
    # of finding a hung card, 4.5 s: inside the 5 s promised (docs/pool.md) with room for a loaded host.
    health_interval_s: float = 0.5
    stall_timeout_s: float = 4.0
    # Background loops.
    discovery_interval_s: float = 5.0
    # Shutdown.
    drain_timeout_s: float = 300.0
    stop_grace_s: float = 5.0

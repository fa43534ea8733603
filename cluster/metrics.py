"""Prometheus metrics of a card and of the router; names and labels are docs/metrics.md's contract."""

from __future__ import annotations

from collections.abc import Mapping

import prometheus_client
from onestream.worker.api import FINISH_REASONS, DraftUsage, Finished
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# No `*_created` series next to every counter and histogram (as vLLM): they double the series count and
# no dashboard reads them. Process-wide, which suits the card and router processes.
prometheus_client.disable_created_metrics()

CARD_LABELS = ("node", "gpu_index", "gpu_uuid", "model")
# Where a speculative draft came from (worker/drafting/): the speculative counters carry it as `source`.
DRAFT_SOURCES = ("mtp", "lookup")

# Seconds. Time to first token spans a cached short suffix (ms) to a long CPU prefill (minutes).
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
INTER_TOKEN_BUCKETS = (
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1.0,
)
REQUEST_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)
QUEUE_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)


class CardMetrics:
    """One card's series, in its own registry (served by the card's /metrics). Thread-safe."""

    def __init__(
        self,
        *,
        node: str,
        gpu_index: int,
        gpu_uuid: str,
        model: str,
        backend: str,
        device_name: str,
        spec_k: int = 0,
        model_format: str = "",
        kv_cache: str = "auto",
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        card = {"node": node, "gpu_index": str(gpu_index), "gpu_uuid": gpu_uuid, "model": model}
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, CARD_LABELS, registry=r).labels(**card)

        self.generation_tokens = counter("onestream_generation_tokens", "Tokens generated.")
        self.prompt_tokens = counter("onestream_prompt_tokens", "Prompt tokens received.")
        self.cached_prompt_tokens = counter(
            "onestream_cached_prompt_tokens", "Prompt tokens served from the session cache."
        )
        self.prefill_tokens = counter("onestream_prefill_tokens", "Prompt tokens actually computed.")
        self.prefix_hits = counter(
            "onestream_prefix_cache_hits", "Turns that reused state found by their prompt's prefix."
        )
        self.prefix_tokens_saved = counter(
            "onestream_prefix_cache_tokens_saved", "Prompt tokens those turns did not prefill."
        )

        def by_source(name: str, doc: str) -> Counter:
            return Counter(name, doc, (*CARD_LABELS, "source"), registry=r)

        self._drafts = by_source("onestream_spec_decode_num_drafts", "Speculative cycles, by draft source.")
        self._draft_tokens = by_source(
            "onestream_spec_decode_num_draft_tokens", "Drafted tokens, by draft source."
        )
        self._accepted_tokens = by_source(
            "onestream_spec_decode_num_accepted_tokens", "Accepted drafted tokens, by draft source."
        )
        self._requests = Counter(
            "onestream_requests", "Finished generations.", (*CARD_LABELS, "finish_reason"), registry=r
        )
        self._accepted_per_pos = Counter(
            "onestream_spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens, by draft source and position (0-based).",
            (*CARD_LABELS, "source", "position"),
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "onestream_time_to_first_token_seconds",
            "Request start on the card to its first token.",
            CARD_LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(**card)
        self.inter_token_latency = Histogram(
            "onestream_inter_token_latency_seconds",
            "Time between streamed tokens.",
            CARD_LABELS,
            buckets=INTER_TOKEN_BUCKETS,
            registry=r,
        ).labels(**card)
        self.e2e_request_latency = Histogram(
            "onestream_e2e_request_latency_seconds",
            "Whole request on the card.",
            CARD_LABELS,
            buckets=REQUEST_BUCKETS,
            registry=r,
        ).labels(**card)
        self.busy = Gauge("onestream_card_busy", "1 while generating.", CARD_LABELS, registry=r).labels(
            **card
        )
        self.cached_sessions = Gauge(
            "onestream_cached_sessions", "Sessions whose state the card holds.", CARD_LABELS, registry=r
        ).labels(**card)
        self.cached_session_bytes = Gauge(
            "onestream_cached_session_bytes", "Memory those sessions hold.", CARD_LABELS, registry=r
        ).labels(**card)
        self.prefix_checkpoints = Gauge(
            "onestream_prefix_checkpoints",
            "Prefix checkpoints shared across sessions.",
            CARD_LABELS,
            registry=r,
        ).labels(**card)
        self.prefix_checkpoint_bytes = Gauge(
            "onestream_prefix_checkpoint_bytes", "Memory those checkpoints hold.", CARD_LABELS, registry=r
        ).labels(**card)
        self.draft_vocab_rows = Gauge(
            "onestream_draft_vocab_rows",
            "Token ids (the first ones) greedy drafts choose among: the vocabulary, or the prefix learnt from the "
            "card's output.",
            CARD_LABELS,
            registry=r,
        ).labels(**card)
        Gauge(
            "onestream_card_info",
            "Card identity, for joins.",
            (*CARD_LABELS, "backend", "device_name", "format", "kv_cache"),
            registry=r,
        ).labels(
            **card, backend=backend, device_name=device_name, format=model_format, kv_cache=kv_cache
        ).set(1)
        self._card = card
        # Labelled series exist at zero from the start: a series born at its first increment hides that
        # increment from rate() and increase().
        for reason in FINISH_REASONS:
            self.requests(reason)
        for source in DRAFT_SOURCES:
            self.source_counters(source)
            for position in range(spec_k):
                self._accepted_per_pos.labels(**card, source=source, position=str(position))

    def source_counters(self, source: str) -> tuple[Counter, Counter, Counter]:
        """(cycles, drafted tokens, accepted tokens) of the drafts from `source`."""
        labels = {**self._card, "source": source}
        return (
            self._drafts.labels(**labels),
            self._draft_tokens.labels(**labels),
            self._accepted_tokens.labels(**labels),
        )

    def requests(self, finish_reason: str) -> Counter:
        return self._requests.labels(**self._card, finish_reason=finish_reason)

    def observe_finished(self, finished: Finished) -> None:
        """Everything but generated tokens, which are counted as they stream."""
        usage, timings = finished.usage, finished.timings
        self.requests(finished.finish_reason).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_prompt_tokens.inc(usage.cached_prompt_tokens)
        self.prefill_tokens.inc(max(usage.prompt_tokens - usage.cached_prompt_tokens, 0))
        # A Usage without a breakdown (an engine that drafts with MTP only) counts as MTP's.
        by_source = usage.by_source or (
            {
                "mtp": DraftUsage(
                    usage.drafts, usage.draft_tokens, usage.accepted_draft_tokens, usage.accepted_per_position
                )
            }
            if usage.drafts
            else {}
        )
        for source, counts in by_source.items():
            drafts, draft_tokens, accepted_tokens = self.source_counters(source)
            drafts.inc(counts.drafts)
            draft_tokens.inc(counts.draft_tokens)
            accepted_tokens.inc(counts.accepted_tokens)
            for position, accepted in enumerate(counts.accepted_per_position):
                self._accepted_per_pos.labels(**self._card, source=source, position=str(position)).inc(
                    accepted
                )
        if usage.generated_tokens:  # a request that generated nothing has no first token
            self.time_to_first_token.observe(timings.time_to_first_token_s)
        for gap in timings.inter_token_s:
            self.inter_token_latency.observe(gap)
        self.e2e_request_latency.observe(timings.total_s)

    def set_sessions(self, count: int, nbytes: int) -> None:
        self.cached_sessions.set(count)
        self.cached_session_bytes.set(nbytes)

    def observe_prefix_hit(self, tokens_saved: int) -> None:
        """A turn's prompt state came by prefix lookup (not its own session): `tokens_saved` > 0."""
        if tokens_saved > 0:
            self.prefix_hits.inc()
            self.prefix_tokens_saved.inc(tokens_saved)

    def set_prefix_checkpoints(self, count: int, nbytes: int) -> None:
        self.prefix_checkpoints.set(count)
        self.prefix_checkpoint_bytes.set(nbytes)

    def set_draft_vocab(self, rows: int) -> None:
        self.draft_vocab_rows.set(rows)


class RouterMetrics:
    """The router's series (labels: model), in its own registry. The per-user counters carry a `user`
    label only with `per_user` (one set of series per user); otherwise they sum over users."""

    REJECTION_REASONS = (
        "queue_full",
        "invalid_argument",
        "deadline",
        "draining",
        "no_cards",
        "unauthenticated",
        "permission_denied",
        "user_concurrent",
        "user_queued",
    )
    MISS_REASONS = ("new_session", "home_busy", "home_gone")
    PREFIX_MISS_REASONS = ("none_held", "card_busy")
    CARD_STATES = ("free", "busy", "down")

    def __init__(self, model: str, *, per_user: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.model = model
        self.per_user = per_user
        user_labels = ("model", "user") if per_user else ("model",)
        self._user_requests = Counter(
            "onestream_router_user_requests",
            "Generate calls of authenticated callers.",
            user_labels,
            registry=r,
        )
        self._user_prompt_tokens = Counter(
            "onestream_router_user_prompt_tokens",
            "Prompt tokens of finished requests.",
            user_labels,
            registry=r,
        )
        self._user_generation_tokens = Counter(
            "onestream_router_user_generation_tokens", "Tokens streamed to callers.", user_labels, registry=r
        )
        self._user_rejections = Counter(
            "onestream_router_user_rejections",
            "Requests of authenticated callers rejected before a card.",
            (*user_labels, "reason"),
            registry=r,
        )
        self.queue_depth = Gauge(
            "onestream_router_queue_depth", "Requests waiting for a card.", ("model",), registry=r
        ).labels(model=model)
        # Labelled with the card the request got, so queue wait can be read per card as well as in total.
        self._queue_time = Histogram(
            "onestream_request_queue_time_seconds",
            "Time from arrival to a card.",
            ("model", "node", "gpu_index", "gpu_uuid"),
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self._rejections = Counter(
            "onestream_router_rejections", "Rejected requests.", ("model", "reason"), registry=r
        )
        self.affinity_hits = Counter(
            "onestream_router_affinity_hits",
            "Turns served by the session's home card.",
            ("model",),
            registry=r,
        ).labels(model=model)
        self._affinity_misses = Counter(
            "onestream_router_affinity_misses",
            "Turns moved or placed fresh.",
            ("model", "reason"),
            registry=r,
        )
        self.prefix_hits = Counter(
            "onestream_router_prefix_hits",
            "Turns without a home placed on a card holding a prefix of their prompt.",
            ("model",),
            registry=r,
        ).labels(model=model)
        self._prefix_misses = Counter(
            "onestream_router_prefix_misses",
            "Turns without a home placed on a card holding no prefix of their prompt.",
            ("model", "reason"),
            registry=r,
        )
        self._cards = Gauge("onestream_router_cards", "Cards by state.", ("model", "state"), registry=r)
        self.sessions = Gauge(
            "onestream_router_sessions", "Sessions with a home card.", ("model",), registry=r
        ).labels(model=model)
        # Zero series exist from the start, so that rate() and dashboards see them before the first event.
        for reason in self.REJECTION_REASONS:
            self._rejections.labels(model=model, reason=reason)
        if not per_user:
            self.add_user(None)
        for reason in self.MISS_REASONS:
            self._affinity_misses.labels(model=model, reason=reason)
        for reason in self.PREFIX_MISS_REASONS:
            self._prefix_misses.labels(model=model, reason=reason)
        for state in self.CARD_STATES:
            self._cards.labels(model=model, state=state)

    def observe_queue_time(self, card_id: str, seconds: float) -> None:
        """A request waited `seconds` before `card_id` (`<node>/<gpu_index>/<gpu_uuid>`) took it."""
        self._queue_time_of(card_id).observe(seconds)

    def add_card(self, card_id: str) -> None:
        """Export the card's queue-wait series at zero from the start, so rate() counts its first requests."""
        self._queue_time_of(card_id)

    def _queue_time_of(self, card_id: str) -> Histogram:
        node, gpu_index, gpu_uuid = card_id.split("/", 2)
        return self._queue_time.labels(model=self.model, node=node, gpu_index=gpu_index, gpu_uuid=gpu_uuid)

    def rejected(self, reason: str) -> None:
        self._rejections.labels(model=self.model, reason=reason).inc()

    def affinity(self, outcome: str) -> None:
        if outcome == "hit":
            self.affinity_hits.inc()
        else:
            self._affinity_misses.labels(model=self.model, reason=outcome).inc()

    def prefix_routing(self, outcome: str) -> None:
        """How a turn without a home was placed ("" for turns that went home: not counted)."""
        if outcome == "hit":
            self.prefix_hits.inc()
        elif outcome:
            self._prefix_misses.labels(model=self.model, reason=outcome).inc()

    def set_cards(self, counts: Mapping[str, int]) -> None:
        for state in self.CARD_STATES:
            self._cards.labels(model=self.model, state=state).set(counts.get(state, 0))

    # ---- per user ---------------------------------------------------------------------------------
    def add_user(self, user: str | None) -> None:
        """Export a user's series at zero (the users of the key file, at start and on every reload)."""
        labels = self._user(user)
        for counter in (self._user_requests, self._user_prompt_tokens, self._user_generation_tokens):
            counter.labels(**labels)
        for reason in self.REJECTION_REASONS:
            if reason != "unauthenticated":  # a rejected key has no user
                self._user_rejections.labels(**labels, reason=reason)

    def user_request(self, user: str | None) -> None:
        self._user_requests.labels(**self._user(user)).inc()

    def user_tokens(self, user: str | None, *, prompt: int = 0, generated: int = 0) -> None:
        labels = self._user(user)
        if prompt:
            self._user_prompt_tokens.labels(**labels).inc(prompt)
        if generated:
            self._user_generation_tokens.labels(**labels).inc(generated)

    def user_rejected(self, user: str | None, reason: str) -> None:
        self._user_rejections.labels(**self._user(user), reason=reason).inc()

    def _user(self, user: str | None) -> dict[str, str]:
        if self.per_user:
            return {"model": self.model, "user": user or ""}
        return {"model": self.model}

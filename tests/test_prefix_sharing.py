"""Prefixes shared across sessions and requests without session ids, on one engine: a shared 2K-token prefix
prefilled once, conversations continued without an id, the user/team scope, eviction within the budget.
Outputs are compared with an engine that caches nothing (a cold prefill)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from onestream.worker.api import SamplingParams
from onestream.worker.backend import ReferenceBackend
from onestream.worker.engine import Engine, Finished, GenerateRequest, TokenChunk
from onestream.worker.prefixes import (
    MIN_PREFIX_TOKENS,
    REUSE_CONVERSATION,
    REUSE_SHARED,
    message_boundaries,
    sharing_scope,
)
from onestream.worker.sequence import Sequence
from onestream.worker.sessions import Session, SessionCache
from onestream.worker.testing import IM_END, IM_START, special_token_id
from onestream.worker.testing_spec import write_draftable_checkpoint

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0)
START, END = special_token_id(IM_START), special_token_id(IM_END)
PREFIX_TOKENS = 2048


class CountingBackend(ReferenceBackend):
    """The reference back end, counting the prompt tokens it prefills (the last prompt token runs alone,
    as a decode step)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.prefilled = 0

    def prefill(self, input_ids: torch.Tensor, state: object):  # type: ignore[no-untyped-def]
        self.prefilled += input_ids.numel()
        return super().prefill(input_ids, state)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_draftable_checkpoint(tmp_path_factory.mktemp("prefixes"), seed=5)


@pytest.fixture(scope="module")
def cold(model_dir: Path) -> Engine:
    """Caches nothing: every turn is a cold prefill."""
    return Engine(model_dir, backend="reference", device="cpu", dtype="fp32", spec_k=2, cache_bytes=0)


def engine_on(cold: Engine, **options: object) -> Engine:
    return Engine(cold.model_dir, backend=CountingBackend(cold.backend.model), spec_k=2, **options)  # type: ignore[arg-type]


def turn(
    engine: Engine, prompt: list[int], session: str | None = None, user: str | None = None
) -> tuple[list[int], Finished]:
    request = GenerateRequest(prompt, GREEDY, max_tokens=12, session_id=session, user=user, ignore_eos=True)
    ids: list[int] = []
    finished = None
    for item in engine.generate(request):
        if isinstance(item, TokenChunk):
            ids.extend(item.token_ids)
        else:
            finished = item
    assert finished is not None
    return ids, finished


def tokens(n: int) -> list[int]:
    return torch.randint(0, 256, (n,)).tolist()


def message(n: int) -> list[int]:
    """One ChatML-shaped message of n tokens: start marker, body, end marker."""
    return [START, *tokens(n - 2), END]


def system_prompt(n: int = PREFIX_TOKENS) -> list[int]:
    return message(n)


def user_turn(n: int) -> list[int]:
    """A user message, then the generation prompt's start marker and header."""
    return [*message(n), START, *tokens(2)]


def test_a_second_session_prefills_only_what_follows_the_shared_prefix(cold: Engine) -> None:
    engine = engine_on(cold)
    shared = system_prompt()
    first, second = shared + user_turn(30), shared + user_turn(40)
    turn(engine, first, "a")
    assert engine.shared_prefixes()[0] == 1  # at the boundary after the system prompt
    backend = engine.backend
    assert isinstance(backend, CountingBackend)
    backend.prefilled = 0
    out, finished = turn(engine, second, "b")
    assert finished.usage.cached_prompt_tokens == PREFIX_TOKENS
    assert backend.prefilled == len(second) - PREFIX_TOKENS - 1  # the suffix, less its last token
    assert engine.last_reuse.source == REUSE_SHARED and engine.last_reuse.by_prefix
    assert out == turn(cold, second)[0]


def test_a_conversation_without_a_session_id_continues_its_state(cold: Engine) -> None:
    engine = engine_on(cold)
    p1 = system_prompt(200) + user_turn(20)
    o1, f1 = turn(engine, p1)
    assert f1.usage.cached_prompt_tokens == 0
    p2 = [*p1, *o1, END, *user_turn(15)]
    o2, f2 = turn(engine, p2)
    assert f2.usage.cached_prompt_tokens == len(p1) + len(o1) - 1
    assert engine.last_reuse.source == REUSE_CONVERSATION
    assert o2 == turn(cold, p2)[0]
    anonymous = [s for s in engine.sessions() if s.session_id.startswith("anonymous-")]
    assert len(anonymous) == 1  # the second turn continued the first one's session
    # A different conversation on the same system prompt starts from the shared prefix, in a new session.
    p3 = p1[:200] + user_turn(25)
    o3, f3 = turn(engine, p3)
    assert f3.usage.cached_prompt_tokens == 200 and engine.last_reuse.source == REUSE_SHARED
    assert o3 == turn(cold, p3)[0]
    assert len([s for s in engine.sessions() if s.session_id.startswith("anonymous-")]) == 2


def test_prefixes_are_shared_within_a_user_unless_the_team_shares(cold: Engine) -> None:
    shared = system_prompt(300)
    by_user = engine_on(cold)
    turn(by_user, shared + user_turn(20), "alice-1", user="alice")
    assert turn(by_user, shared + user_turn(21), "alice-2", user="alice")[1].usage.cached_prompt_tokens == 300
    assert turn(by_user, shared + user_turn(22), "bob-1", user="bob")[1].usage.cached_prompt_tokens == 0
    # Nor does bob continue alice's conversation by sending it without a session id.
    alice = shared + user_turn(23)
    o, _ = turn(by_user, alice, user="alice")
    follow_up = [*alice, *o, END, *user_turn(9)]
    assert turn(by_user, follow_up, user="bob")[1].usage.cached_prompt_tokens == 300  # bob's own prefix
    assert by_user.last_reuse.source == REUSE_SHARED

    team = engine_on(cold, prefix_sharing="team")
    turn(team, shared + user_turn(20), "alice-1", user="alice")
    assert turn(team, shared + user_turn(22), "bob-1", user="bob")[1].usage.cached_prompt_tokens == 300
    assert sharing_scope("alice", "team") == sharing_scope("bob", "team") == sharing_scope(None, "user")
    with pytest.raises(ValueError, match="prefix sharing"):
        engine_on(cold, prefix_sharing="everyone")


def test_boundaries_skip_short_prefixes_and_the_generation_prompt() -> None:
    markers = frozenset({START})
    prompt = [START, *tokens(10), START, *tokens(100), START, *tokens(50), START, 7, 8]
    last = len(prompt) - 3
    assert message_boundaries(prompt, markers, 0, len(prompt) - 2) == [112]
    assert 11 < MIN_PREFIX_TOKENS < 112 < last
    assert message_boundaries(prompt, markers, 112, len(prompt) - 2) == []  # 163 starts the last message
    assert message_boundaries(prompt, frozenset(), 0, len(prompt)) == []


def test_the_least_valuable_go_first_under_a_small_budget(cold: Engine) -> None:
    backend = cold.backend

    def full_checkpoint(n: int) -> tuple[list[int], object]:
        seq = Sequence(backend, 1024, track_mtp=True)
        prompt = tokens(n)
        seq.feed(prompt)
        return prompt, seq.checkpoint(full=True)

    session = Session("s", Sequence(backend, 1024, track_mtp=True))
    session.sequence.feed(tokens(40))
    (used_tokens, used), (_, unused) = full_checkpoint(200), full_checkpoint(200)
    cache = SessionCache(max_bytes=session.nbytes() + used.nbytes + unused.nbytes // 2)  # type: ignore[attr-defined]
    cache.add_prefix("team", used)  # type: ignore[arg-type]
    cache.prefixes.used(next(iter(cache.prefixes)))
    cache.add_prefix("team", unused)  # type: ignore[arg-type]
    cache.put(session)
    kept = list(cache.prefixes)
    assert [p.checkpoint for p in kept] == [used] and "s" in cache  # the never-reused prefix went first
    assert cache.nbytes() <= cache.max_bytes
    # Then least recently used, sessions and reused prefixes alike: a newer session pushes out both.
    newer = Session("t", Sequence(backend, 1024, track_mtp=True))
    newer.sequence.feed(tokens(40))
    small = SessionCache(max_bytes=newer.nbytes() + session.nbytes() // 2)
    small.add_prefix("team", used)  # type: ignore[arg-type]
    small.prefixes.used(next(iter(small.prefixes)))
    small.put(session)
    small.put(newer)
    assert list(small.prefixes) == [] and "s" not in small and "t" in small
    assert cache.prefixes.longest("team", [*used_tokens, 1]) is kept[0]


def test_prefix_points_list_what_requests_without_ids_can_continue(cold: Engine) -> None:
    engine = engine_on(cold)
    shared = system_prompt(100)
    named = shared + user_turn(10)
    named_out, _ = turn(engine, named, "named", user="carol")
    prompt = shared + user_turn(12)
    out, _ = turn(engine, prompt, user="carol")
    points = engine.prefix_points()
    scope = sharing_scope("carol", "user")
    assert (scope, tuple(shared)) in points  # the shared prefix
    held = tuple(prompt + out[:-1])  # the anonymous session's state: all but the last output token
    assert (scope, held) in points and (scope, tuple(prompt[:-1])) in points
    assert (scope, tuple(named + named_out[:-1])) not in points  # a named session is not taken over

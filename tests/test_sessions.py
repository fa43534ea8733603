"""The session cache: suffix-only prefill for extending turns, checkpoint reuse for divergent prompts, outputs
equal to a fresh engine's, LRU eviction within a byte budget, closing sessions, cancellation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from onestream.worker.api import SamplingParams
from onestream.worker.engine import Engine, Finished, GenerateRequest, TokenChunk
from onestream.worker.errors import UnknownSessionError
from onestream.worker.sequence import Sequence
from onestream.worker.sessions import Session, SessionCache
from onestream.worker.testing_spec import write_draftable_checkpoint

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_draftable_checkpoint(tmp_path_factory.mktemp("sessions"), seed=3)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(model_dir, backend="reference", device="cpu", dtype="fp32", spec_k=2)


@pytest.fixture(scope="module")
def fresh(engine: Engine, model_dir: Path) -> Engine:
    """A second engine on the same loaded model, never given a session."""
    return Engine(model_dir, backend=engine.backend, spec_k=2, cache_bytes=0)


def turn(
    engine: Engine, prompt: list[int], session: str | None, max_tokens: int = 16
) -> tuple[list[int], Finished]:
    ids: list[int] = []
    finished = None
    for item in engine.generate(
        GenerateRequest(prompt, GREEDY, max_tokens=max_tokens, session_id=session, ignore_eos=True)
    ):
        if isinstance(item, TokenChunk):
            ids.extend(item.token_ids)
        else:
            finished = item
    assert finished is not None
    return ids, finished


def tokens(n: int) -> list[int]:
    return torch.randint(0, 256, (n,)).tolist()


def test_extending_turn_prefills_only_the_suffix(engine: Engine, fresh: Engine) -> None:
    p1 = tokens(20)
    o1, f1 = turn(engine, p1, "extend")
    assert f1.usage.cached_prompt_tokens == 0
    p2 = p1 + o1 + tokens(7)
    o2, f2 = turn(engine, p2, "extend")
    # The state holds the prompt and every output token but the last (not yet run).
    assert f2.usage.cached_prompt_tokens == len(p1) + len(o1) - 1
    assert o2 == turn(fresh, p2, None)[0]
    p3 = p2 + o2 + tokens(5)
    o3, f3 = turn(engine, p3, "extend")
    assert f3.usage.cached_prompt_tokens == len(p2) + len(o2) - 1
    assert o3 == turn(fresh, p3, None)[0]


def test_divergent_prompt_restores_a_checkpoint(engine: Engine, fresh: Engine) -> None:
    p1 = tokens(24)
    o1, _ = turn(engine, p1, "diverge")
    # The client rewrote the assistant's answer: diverges inside the last output.
    p2 = [*p1, *o1[:3], (o1[3] + 1) % 256, *tokens(6)]
    o2, f2 = turn(engine, p2, "diverge")
    assert f2.usage.cached_prompt_tokens == len(p1) - 1  # the end-of-prompt checkpoint
    assert o2 == turn(fresh, p2, None)[0]


def test_regenerating_a_turn_reuses_all_but_one_prompt_token(engine: Engine) -> None:
    p1 = tokens(15)
    first, _ = turn(engine, p1, "regen")
    again, f = turn(engine, p1, "regen")
    assert f.usage.cached_prompt_tokens == len(p1) - 1
    assert again == first


def test_edited_last_message_restores_the_previous_turns_end(engine: Engine, fresh: Engine) -> None:
    p1 = tokens(10)
    o1, _ = turn(engine, p1, "edit")
    p2 = p1 + o1 + tokens(8)
    turn(engine, p2, "edit")
    p3 = p1 + o1 + tokens(9)  # the user message of turn 2, edited
    if p3[: len(p2)] == p2:  # astronomically unlikely, but then this is an extension
        p3[len(p1) + len(o1)] = (p3[len(p1) + len(o1)] + 1) % 256
    o3, f3 = turn(engine, p3, "edit")
    assert f3.usage.cached_prompt_tokens == len(p1) + len(o1) - 1
    assert o3 == turn(fresh, p3, None)[0]


def test_unrelated_prompt_recomputes_everything(engine: Engine) -> None:
    p1 = tokens(12)
    turn(engine, p1, "unrelated")
    p2 = [(p1[0] + 1) % 256, *tokens(12)]
    _, f = turn(engine, p2, "unrelated")
    assert f.usage.cached_prompt_tokens == 0


def test_cancelled_turn_leaves_a_consistent_session(engine: Engine, fresh: Engine) -> None:
    p1 = tokens(16)
    stream = engine.generate(
        GenerateRequest(p1, GREEDY, max_tokens=100, session_id="cancel", ignore_eos=True)
    )
    partial: list[int] = []
    for item in stream:
        assert isinstance(item, TokenChunk)
        partial.extend(item.token_ids)
        if len(partial) >= 5:
            break
    stream.close()
    p2 = p1 + partial + tokens(4)
    o2, f2 = turn(engine, p2, "cancel")
    assert f2.usage.cached_prompt_tokens == len(p1) + len(partial) - 1
    assert o2 == turn(fresh, p2, None)[0]


def test_sessions_listing_and_closing(engine: Engine) -> None:
    turn(engine, tokens(8), "listed")
    listed = {s.session_id: s for s in engine.sessions()}
    assert "listed" in listed and listed["listed"].tokens > 8 and listed["listed"].nbytes > 0
    engine.close_session("listed")
    assert "listed" not in {s.session_id for s in engine.sessions()}
    with pytest.raises(UnknownSessionError, match="listed"):
        engine.close_session("listed")


def test_lru_eviction_under_a_byte_budget(engine: Engine, model_dir: Path) -> None:
    probe = Engine(model_dir, backend=engine.backend, spec_k=2)
    turn(probe, tokens(20), "probe")
    one_session = probe.cached_bytes()
    assert one_session > 0
    small = Engine(model_dir, backend=engine.backend, spec_k=2, cache_bytes=int(2.5 * one_session))
    prompts = {name: tokens(20) for name in "abc"}
    outputs = {name: turn(small, prompts[name], name)[0] for name in "abc"}
    assert {s.session_id for s in small.sessions()} == {"b", "c"}  # "a" was least recently used
    assert small.cached_bytes() <= 2.5 * one_session
    _, fa = turn(small, prompts["a"] + outputs["a"] + tokens(3), "a")
    assert fa.usage.cached_prompt_tokens == 0  # evicted: recomputed
    assert {s.session_id for s in small.sessions()} == {"c", "a"}
    _, fc = turn(small, prompts["c"] + outputs["c"] + tokens(3), "c")
    assert fc.usage.cached_prompt_tokens > 0


def test_a_session_larger_than_the_budget_sheds_checkpoints_then_itself(engine: Engine) -> None:
    session = Session("big", Sequence(engine.backend, 256, track_mtp=True))
    session.sequence.feed(tokens(30))
    session.add_checkpoint(4)
    session.sequence.feed(tokens(10))
    session.add_checkpoint(4)
    assert len(session.checkpoints) == 2
    state_only = session.sequence.nbytes()
    cache = SessionCache(max_bytes=state_only + session.checkpoints[1].nbytes)
    cache.put(session)
    assert "big" in cache and len(session.checkpoints) == 1  # the oldest checkpoint went first
    tiny = SessionCache(max_bytes=state_only - 1)
    tiny.put(session)
    assert "big" not in tiny and len(tiny) == 0


def test_checkpoints_per_session_are_bounded(engine: Engine) -> None:
    session = Session("bounded", Sequence(engine.backend, 256, track_mtp=True))
    for _ in range(6):
        session.sequence.feed(tokens(4))
        session.add_checkpoint(3)
    assert [len(c.tokens) for c in session.checkpoints] == [16, 20, 24]


def test_closing_the_session_in_use_drops_it_when_the_turn_ends(engine: Engine) -> None:
    stream = engine.generate(
        GenerateRequest(tokens(10), GREEDY, max_tokens=8, session_id="busy", ignore_eos=True)
    )
    next(stream)
    assert "busy" in {s.session_id for s in engine.sessions()}
    engine.close_session("busy")
    assert "busy" not in {s.session_id for s in engine.sessions()}
    assert isinstance(list(stream)[-1], Finished)
    assert "busy" not in {s.session_id for s in engine.sessions()}
    with pytest.raises(UnknownSessionError):
        engine.close_session("busy")


def test_checkpoints_cost_the_deltanet_state_not_the_context(engine: Engine) -> None:
    seq = Sequence(engine.backend, 1024, track_mtp=True)
    seq.feed(tokens(10))
    short = seq.checkpoint()
    seq.feed(tokens(400))
    long = seq.checkpoint()
    assert short.nbytes == long.nbytes < seq.nbytes() / 4
    session = Session("light", seq, [short, long])
    assert session.nbytes() == seq.nbytes() + 2 * long.nbytes  # what the cache's byte budget counts


def test_restoring_a_checkpoint_whose_mtp_pairs_are_still_owed(engine: Engine) -> None:
    """Restore an early checkpoint, re-run tokens without drafting (their MTP pairs are owed), then restore a
    later checkpoint: the owed pairs it needs are run first, and drafting continues as from scratch."""
    backend = engine.backend
    prefix, middle, tail = tokens(12), tokens(10), tokens(5)
    seq = Sequence(backend, 256, track_mtp=True)
    seq.feed(prefix)
    early = seq.checkpoint()
    seq.feed(middle)
    late = seq.checkpoint()
    seq.feed(tail)
    seq.restore(early)
    seq.feed(middle)
    seq.feed(tail[:2])
    assert seq.can_restore(late)
    seq.restore(late)
    assert seq.tokens == prefix + middle
    fresh_seq = Sequence(backend, 256, track_mtp=True)
    fresh_seq.feed(prefix + middle)
    torch.testing.assert_close(
        seq.draft_first(tail[0]).logits[-1], fresh_seq.draft_first(tail[0]).logits[-1], rtol=1e-4, atol=1e-4
    )


def test_a_checkpoint_of_an_abandoned_branch_is_dropped(engine: Engine, fresh: Engine) -> None:
    p1 = tokens(14)
    o1, _ = turn(engine, p1, "branch")
    p2 = p1 + o1 + tokens(6)
    turn(engine, p2, "branch")  # checkpoints: end of p1 - 1, end of turn 1, end of p2 - 1
    session = next(s for s in engine.sessions() if s.session_id == "branch")
    assert session.checkpoints == 3
    p3 = [*p1[:-1], (p1[-1] + 1) % 256, *tokens(4)]  # diverges at p1's last token
    o3, f3 = turn(engine, p3, "branch")
    assert f3.usage.cached_prompt_tokens == len(p1) - 1
    assert o3 == turn(fresh, p3, None)[0]
    session = next(s for s in engine.sessions() if s.session_id == "branch")
    assert session.checkpoints == 2  # p1 - 1 (still a prefix) and p3 - 1; turn 2's are gone

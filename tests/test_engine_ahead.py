"""Plain decoding one step ahead of the host (`Sequence.decode_run`): greedy, penalised and sampled requests give
the same tokens as a decode that synchronises every step, stops and cancellation are honoured, and the session's
state is consistent afterwards (the step run ahead consumed the last emitted token, which the state then
holds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from onestream.worker.api import SamplingParams
from onestream.worker.backend import ReferenceBackend
from onestream.worker.engine import Engine, Finished, GenerateRequest, TokenChunk
from onestream.worker.loading import load_model
from onestream.worker.testing_spec import write_draftable_checkpoint

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0)


class SyncedBackend(ReferenceBackend):
    """The reference back end without the queued step: the engine falls back to one synchronised step at a
    time (what every plain greedy step did before)."""

    decode_ahead = None  # type: ignore[assignment]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_draftable_checkpoint(tmp_path_factory.mktemp("ahead"), seed=4)


@pytest.fixture(scope="module")
def model(model_dir: Path):  # type: ignore[no-untyped-def]
    return load_model(model_dir, dtype=torch.float32, device="cpu")


def plain_engine(model_dir: Path, backend: ReferenceBackend) -> Engine:
    return Engine(model_dir, backend=backend, spec_k=0, max_context=512)


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """n greedy tokens by the model's own step, one at a time."""
    state = model.new_state(len(prompt) + n + 1)
    out = model.forward_step(torch.tensor(prompt), state, logits="last")
    tokens = []
    for _ in range(n):
        token = int(out.logits[-1].argmax())
        tokens.append(token)
        out = model.forward_step(torch.tensor([token]), state)
    return tokens


def ids_and_end(engine: Engine, request: GenerateRequest) -> tuple[list[int], Finished]:
    items = list(engine.generate(request))
    assert isinstance(items[-1], Finished)
    return [t for c in items[:-1] if isinstance(c, TokenChunk) for t in c.token_ids], items[-1]


def session_sequence(engine: Engine, session_id: str):  # type: ignore[no-untyped-def]
    session = engine._sessions.take(session_id)
    assert session is not None
    engine._sessions.put(session)
    return session.sequence


def prompt_of(seed: int, n: int = 10) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_run_ahead_gives_the_tokens_of_a_synced_decode(model_dir: Path, model) -> None:  # type: ignore[no-untyped-def]
    ahead = plain_engine(model_dir, ReferenceBackend(model))
    synced = plain_engine(model_dir, SyncedBackend(model))
    for seed in range(3):
        prompt = prompt_of(seed)
        request = GenerateRequest(prompt, GREEDY, max_tokens=24, ignore_eos=True)
        got, end = ids_and_end(ahead, request)
        assert got == ids_and_end(synced, request)[0] == reference_greedy(model, prompt, 24)
        assert end.finish_reason == "length" and len(end.timings.inter_token_s) == 23


def test_max_tokens_never_runs_a_step_past_the_last_token(model_dir: Path, model) -> None:  # type: ignore[no-untyped-def]
    engine = plain_engine(model_dir, ReferenceBackend(model))
    prompt = prompt_of(7)
    got, _ = ids_and_end(
        engine, GenerateRequest(prompt, GREEDY, max_tokens=9, session_id="s", ignore_eos=True)
    )
    seq = session_sequence(engine, "s")
    assert seq.tokens == prompt + got[:-1]  # as a synced decode leaves it: the last token not yet run
    assert seq.state.length == len(seq.tokens)


def test_a_stop_leaves_the_run_ahead_step_in_a_consistent_state(model_dir: Path, model) -> None:  # type: ignore[no-untyped-def]
    engine = plain_engine(model_dir, ReferenceBackend(model))
    prompt = prompt_of(11)
    free = reference_greedy(model, prompt, 30)
    stop = free[5]
    request = GenerateRequest(
        prompt, GREEDY, max_tokens=30, stop_token_ids=[stop], session_id="t", ignore_eos=True
    )
    got, end = ids_and_end(engine, request)
    assert end.finish_reason == "stop" and end.stop_reason == stop
    assert got == free[: free.index(stop) + 1]
    seq = session_sequence(engine, "t")
    # The step queued ahead ran the stop token: the state holds every emitted token.
    assert seq.tokens == prompt + got and seq.state.length == len(seq.tokens)
    assert torch.equal(seq.last_hidden, seq.last_hidden)  # set (a tensor), not None
    # The next turn continues from that state and decodes what a fresh decode of the whole text does.
    follow = [*prompt, *got, *prompt_of(12, 4)]
    again, _ = ids_and_end(
        engine, GenerateRequest(follow, GREEDY, max_tokens=12, session_id="t", ignore_eos=True)
    )
    assert engine.last_reuse.tokens == len(prompt) + len(got)
    assert again == reference_greedy(model, follow, 12)


def test_closing_the_stream_mid_run_keeps_the_session_usable(model_dir: Path, model) -> None:  # type: ignore[no-untyped-def]
    engine = plain_engine(model_dir, ReferenceBackend(model))
    prompt = prompt_of(21)
    stream = engine.generate(GenerateRequest(prompt, GREEDY, max_tokens=200, session_id="c", ignore_eos=True))
    got = [t for _, item in zip(range(6), stream, strict=False) for t in item.token_ids]
    stream.close()
    assert not engine.busy
    seq = session_sequence(engine, "c")
    assert seq.tokens == prompt + got and seq.state.length == len(seq.tokens)
    follow = [*prompt, *got]
    again, _ = ids_and_end(
        engine, GenerateRequest(follow, GREEDY, max_tokens=10, session_id="c", ignore_eos=True)
    )
    assert again == reference_greedy(model, follow, 10)


def test_cancel_by_request_id_stops_a_run_ahead(model_dir: Path, model) -> None:  # type: ignore[no-untyped-def]
    engine = plain_engine(model_dir, ReferenceBackend(model))
    stream = engine.generate(
        GenerateRequest(prompt_of(31), GREEDY, max_tokens=200, request_id="r", ignore_eos=True)
    )
    next(stream)
    assert engine.cancel("r")
    rest = list(stream)
    assert isinstance(rest[-1], Finished) and rest[-1].finish_reason == "cancelled"
    assert rest[-1].usage.generated_tokens < 200


def test_biased_greedy_requests_do_not_take_the_device_argmax(model_dir: Path, model) -> None:  # type: ignore[no-untyped-def]
    prompt = prompt_of(41)
    favoured = 7 if reference_greedy(model, prompt, 1)[0] != 7 else 8
    biased = SamplingParams(temperature=0.0, logit_bias=((favoured, 100.0),))
    plain = plain_engine(model_dir, ReferenceBackend(model))
    got, _ = ids_and_end(plain, GenerateRequest(prompt, biased, max_tokens=8, ignore_eos=True))
    assert got == [favoured] * 8
    # Speculative cycles apply the bias too (their greedy acceptance on the device takes the plain argmax).
    spec = Engine(model_dir, backend=ReferenceBackend(model), spec_k=2, max_context=512)
    assert ids_and_end(spec, GenerateRequest(prompt, biased, max_tokens=8, ignore_eos=True))[0] == got


class CountingBackend(ReferenceBackend):
    """Counts the steps queued ahead of the host: the run-ahead path serves the request when they move."""

    queued = 0

    def decode_ahead(self, input_ids, state):  # type: ignore[no-untyped-def]
        self.queued += 1
        return super().decode_ahead(input_ids, state)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.4),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=5),
        SamplingParams(temperature=1.2, repetition_penalty=1.1, seed=9),
    ],
    ids=["repetition", "presence-frequency", "truncated-sample", "penalised-sample"],
)
def test_penalised_and_sampled_requests_run_ahead_with_the_synced_tokens(
    model_dir: Path,
    model,
    sampling: SamplingParams,  # type: ignore[no-untyped-def]
) -> None:
    backend = CountingBackend(model)
    ahead, synced = plain_engine(model_dir, backend), plain_engine(model_dir, SyncedBackend(model))
    for seed in range(2):
        request = GenerateRequest(prompt_of(50 + seed), sampling, max_tokens=20, ignore_eos=True)
        before = backend.queued
        got, end = ids_and_end(ahead, request)
        assert got == ids_and_end(synced, request)[0]
        assert end.finish_reason == "length" and len(got) == 20
        assert backend.queued - before == 19  # every token after the first came from a queued step
    # The penalty changes what greedy picks here, so the run ahead applies it rather than the plain argmax.
    penalised = GenerateRequest(prompt_of(50), sampling, max_tokens=20, ignore_eos=True)
    if sampling.greedy:
        assert ids_and_end(ahead, penalised)[0] != reference_greedy(model, prompt_of(50), 20)


def test_a_stop_in_a_sampled_run_keeps_the_session_consistent(model_dir: Path, model) -> None:  # type: ignore[no-untyped-def]
    sampled = SamplingParams(temperature=1.0, seed=3)
    engine = plain_engine(model_dir, ReferenceBackend(model))
    prompt = prompt_of(61)
    free, _ = ids_and_end(engine, GenerateRequest(prompt, sampled, max_tokens=24, ignore_eos=True))
    stop = free[7]
    request = GenerateRequest(
        prompt, sampled, max_tokens=24, stop_token_ids=[stop], session_id="p", ignore_eos=True
    )
    got, end = ids_and_end(engine, request)
    assert end.finish_reason == "stop" and got == free[: free.index(stop) + 1]
    seq = session_sequence(engine, "p")
    assert seq.tokens == prompt + got and seq.state.length == len(seq.tokens)
    follow = [*prompt, *got, *prompt_of(62, 4)]
    again, _ = ids_and_end(
        engine, GenerateRequest(follow, GREEDY, max_tokens=10, session_id="p", ignore_eos=True)
    )
    assert engine.last_reuse.tokens == len(prompt) + len(got)
    assert again == reference_greedy(model, follow, 10)

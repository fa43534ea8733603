"""The engine loop: request validation before any work, streaming (UTF-8-safe text, stop strings across
chunks, stop tokens, EOS, max_tokens), usage and timings, cancellation, one sequence at a time, back ends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from onestream.worker.api import SamplingParams
from onestream.worker.backend import BackendUnavailableError, ReferenceBackend, create_backend
from onestream.worker.engine import Engine, EngineBusyError, Finished, GenerateRequest, TokenChunk
from onestream.worker.errors import ContextLengthError, InvalidRequestError
from onestream.worker.loading import load_model
from onestream.worker.progress import ProgressReport
from onestream.worker.stop import StopChecker
from onestream.worker.testing_spec import write_draftable_checkpoint
from onestream.worker.tokenizer import load_tokenizer

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_draftable_checkpoint(tmp_path_factory.mktemp("engine"), seed=2)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(model_dir, backend="reference", device="cpu", dtype="fp32", spec_k=2, max_context=512)


def run(engine: Engine, request: GenerateRequest) -> tuple[list[TokenChunk], Finished]:
    items = list(engine.generate(request))
    assert isinstance(items[-1], Finished)
    assert all(isinstance(i, TokenChunk) for i in items[:-1])
    return items[:-1], items[-1]  # type: ignore[return-value]


def ids_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def text_of(chunks: list[TokenChunk]) -> str:
    return "".join(c.text for c in chunks)


def random_prompt(engine: Engine, n: int = 12) -> list[int]:
    return torch.randint(0, 256, (n,)).tolist()  # byte tokens: fresh every call


# ---- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": [1, "x"]}, r"prompt\[1\]"),
        ({"prompt": [1, 10**9]}, r"prompt\[1\]"),
        ({"prompt": [{"role": "wizard", "content": "hi"}]}, r"prompt\[0\].role"),
        ({"prompt": [{"role": "user", "content": 3}]}, r"prompt\[0\].content"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"stop": "x"}, "stop"),
        ({"stop": [""]}, r"stop\[0\]"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids\[0\]"),
        ({"session_id": ""}, "session_id"),
        ({"request_id": 7}, "request_id"),
        ({"user": ""}, "user"),
        ({"sampling": SamplingParams(top_p=0)}, "top_p"),
        ({"sampling": SamplingParams(temperature=-1)}, "temperature"),
        ({"sampling": {"temperature": 0}}, "sampling"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_invalid_requests_fail_before_any_work(engine: Engine, changes: dict, field: str) -> None:
    request = GenerateRequest(**({"prompt": "hello", "max_tokens": 4} | changes))
    with pytest.raises(InvalidRequestError, match=field):
        engine.generate(request)  # raises at the call, not at the first next()
    assert not engine.busy
    run(engine, GenerateRequest("hello", GREEDY, max_tokens=2))  # still serves


def test_context_overflow_names_both_numbers(engine: Engine) -> None:
    prompt = random_prompt(engine, 500)
    with pytest.raises(ContextLengthError, match=r"500 tokens.*max_tokens=20.*520.*512"):
        engine.generate(GenerateRequest(prompt, GREEDY, max_tokens=20))
    _, finished = run(engine, GenerateRequest(prompt, GREEDY, max_tokens=12, ignore_eos=True))
    assert finished.usage.prompt_tokens + finished.usage.generated_tokens == 512


# ---- streaming ---------------------------------------------------------------------------------------


def test_stream_shape_usage_and_timings(engine: Engine) -> None:
    prompt = random_prompt(engine)
    chunks, finished = run(engine, GenerateRequest(prompt, GREEDY, max_tokens=30, ignore_eos=True))
    usage, timings = finished.usage, finished.timings
    assert finished.finish_reason == "length"
    assert usage.prompt_tokens == len(prompt) and usage.cached_prompt_tokens == 0
    assert usage.generated_tokens == len(ids_of(chunks)) == 30
    assert usage.drafts > 0 and usage.draft_tokens <= engine.max_drafts * usage.drafts
    assert 1 <= len(usage.accepted_per_position) <= engine.max_drafts
    mtp = usage.by_source.get("mtp")
    # An MTP draft continued by a copy (drafting/policy.py extend_mtp) keeps its source and may reach the lookup's
    # length, so the per-source bound is the engine's longest draft, not spec_k.
    assert mtp is None or 0 < mtp.draft_tokens <= engine.max_drafts * mtp.drafts
    token_chunks = [c for c in chunks if c.token_ids]
    assert len(timings.inter_token_s) == len(token_chunks) - 1
    assert all(t > 0 for t in timings.inter_token_s)
    assert 0 < timings.prefill_s <= timings.time_to_first_token_s <= timings.total_s
    assert timings.decode_s == pytest.approx(timings.total_s - timings.time_to_first_token_s)


def test_text_deltas_are_the_decoded_tokens(engine: Engine, model_dir: Path) -> None:
    tokenizer = load_tokenizer(model_dir)
    text = "def main():\n    print('hello')\n"
    chunks, _ = run(engine, GenerateRequest(text, GREEDY, max_tokens=40, ignore_eos=True))
    ids = ids_of(chunks)
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert text_of(chunks) == decoded


def test_multibyte_characters_are_never_split(model_dir: Path) -> None:
    tokenizer = load_tokenizer(model_dir)
    text = "naïve café → 🙂 日本語 wörld 🚀!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.encode()) // 2  # byte-level: many characters span several tokens
    checker = StopChecker(
        tokenizer.incremental_decoder(), stop_strings=[], stop_token_ids=[], max_tokens=1000
    )
    deltas = [checker.push([t])[1] for t in ids] + [checker.finish("length")]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens completed no character


def test_stop_string_across_chunks_is_not_emitted(engine: Engine) -> None:
    prompt = random_prompt(engine)
    free, _ = run(engine, GenerateRequest(prompt, GREEDY, max_tokens=40, ignore_eos=True))
    full = text_of(free)
    # A stop string that straddles two chunks' text.
    ends = [sum(len(c.text) for c in free[: i + 1]) for i in range(len(free))]
    boundary = next(b for b in ends if 2 <= b <= len(full) - 2)
    stop = full[boundary - 2 : boundary + 2]
    assert len(stop) == 4
    # A second stop string the output never holds (byte tokens can emit any control character, NUL included).
    other = next(c for c in map(chr, range(32)) if c not in full)
    chunks, finished = run(
        engine, GenerateRequest(prompt, GREEDY, max_tokens=40, ignore_eos=True, stop=[stop, other])
    )
    assert finished.finish_reason == "stop" and finished.stop_reason == stop
    assert text_of(chunks) == full[: full.index(stop)]
    assert ids_of(chunks) == ids_of(free)[: len(ids_of(chunks))]


def test_stop_strings_unit() -> None:
    class Letters:  # each token id is one character
        def push(self, token_ids: int) -> str:
            return chr(token_ids)

        def flush(self) -> str:
            return ""

    checker = StopChecker(Letters(), stop_strings=["cde", "xy"], stop_token_ids=[], max_tokens=100)
    assert checker.push([ord("a"), ord("b"), ord("c")]) == (3, "ab")  # "c" may start "cde": held
    assert checker.push([ord("d")]) == (1, "")
    assert checker.push([ord("e"), ord("f")]) == (1, "")
    assert checker.finish_reason == "stop" and checker.stop_reason == "cde"
    checker = StopChecker(Letters(), stop_strings=["cde"], stop_token_ids=[], max_tokens=100)
    assert checker.push([ord("c"), ord("d"), ord("x")]) == (3, "cdx")  # a false start is released
    assert checker.push([ord("c")]) == (1, "")
    assert checker.finish("length") == "c"


def test_stop_token_ids_end_the_generation(engine: Engine) -> None:
    prompt = random_prompt(engine)
    free, _ = run(engine, GenerateRequest(prompt, GREEDY, max_tokens=30, ignore_eos=True))
    ids = ids_of(free)
    stop_id = ids[6]
    chunks, finished = run(
        engine, GenerateRequest(prompt, GREEDY, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    )
    assert ids_of(chunks) == ids[: ids.index(stop_id) + 1]  # the stop token is reported, not decoded
    assert finished.finish_reason == "stop" and finished.stop_reason == stop_id
    assert finished.usage.generated_tokens == ids.index(stop_id) + 1


def test_eos_stops_unless_ignored(model_dir: Path) -> None:
    engine = Engine(model_dir, backend="reference", device="cpu", dtype="fp32", spec_k=3)
    prompt = random_prompt(engine)
    free, _ = run(engine, GenerateRequest(prompt, GREEDY, max_tokens=25, ignore_eos=True))
    ids = ids_of(free)
    engine.eos_token_ids = frozenset({ids[4]})
    _, stopped = run(engine, GenerateRequest(prompt, GREEDY, max_tokens=25))
    assert stopped.finish_reason == "stop" and stopped.usage.generated_tokens == ids.index(ids[4]) + 1
    chunks, ignored = run(engine, GenerateRequest(prompt, GREEDY, max_tokens=25, ignore_eos=True))
    assert ignored.finish_reason == "length" and ids_of(chunks) == ids


def test_max_tokens_one(engine: Engine) -> None:
    chunks, finished = run(
        engine, GenerateRequest(random_prompt(engine), GREEDY, max_tokens=1, ignore_eos=True)
    )
    assert len(ids_of(chunks)) == 1 and finished.finish_reason == "length"
    assert finished.usage.drafts == 0 and finished.timings.inter_token_s == []


def test_chat_messages_use_the_template(engine: Engine) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    _, finished = run(engine, GenerateRequest(messages, GREEDY, max_tokens=3, ignore_eos=True))
    rendered = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert finished.usage.prompt_tokens == len(engine.tokenizer.encode(rendered))


# ---- cancellation and concurrency --------------------------------------------------------------------


def test_closing_the_stream_cancels_and_the_engine_stays_usable(engine: Engine) -> None:
    prompt = random_prompt(engine)
    reference, _ = run(engine, GenerateRequest(prompt, GREEDY, max_tokens=20, ignore_eos=True))
    stream = engine.generate(GenerateRequest(prompt, GREEDY, max_tokens=200, ignore_eos=True))
    next(stream)
    next(stream)
    assert engine.busy
    stream.close()
    assert not engine.busy
    chunks, _ = run(engine, GenerateRequest(prompt, GREEDY, max_tokens=20, ignore_eos=True))
    assert ids_of(chunks) == ids_of(reference)


def test_cancel_by_request_id_finishes_cancelled(engine: Engine) -> None:
    stream = engine.generate(GenerateRequest(random_prompt(engine), GREEDY, max_tokens=200, request_id="r-1"))
    first = next(stream)
    assert isinstance(first, TokenChunk)
    assert not engine.cancel("someone-else")
    assert engine.cancel("r-1")
    rest = list(stream)
    finished = rest[-1]
    assert isinstance(finished, Finished) and finished.finish_reason == "cancelled"
    assert finished.usage.generated_tokens < 200
    assert not engine.busy


def test_a_second_concurrent_generation_is_refused(engine: Engine) -> None:
    stream = engine.generate(GenerateRequest(random_prompt(engine), GREEDY, max_tokens=50))
    next(stream)
    with pytest.raises(EngineBusyError, match="one sequence at a time"):
        engine.generate(GenerateRequest("x", GREEDY, max_tokens=2))
    stream.close()
    run(engine, GenerateRequest("x", GREEDY, max_tokens=2))


# ---- configuration and back ends --------------------------------------------------------------------


def test_model_info_and_spec_k(engine: Engine) -> None:
    info = engine.model_info()
    assert info["backend"] == "reference" and info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["has_mtp"] and info["max_context"] == engine.max_context == 512
    with pytest.raises(ValueError, match="spec_k"):
        engine.spec_k = -1


def test_model_without_mtp_decodes_without_drafts(tmp_path: Path) -> None:
    from onestream.worker.testing import write_tiny_checkpoint

    engine = Engine(write_tiny_checkpoint(tmp_path, with_mtp=False), backend="reference", spec_k=3)
    assert engine.spec_k == 0
    _, finished = run(engine, GenerateRequest("abc", GREEDY, max_tokens=5, ignore_eos=True))
    assert finished.usage.generated_tokens == 5 and finished.usage.drafts == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_forcing_the_megakernel_without_a_gpu_is_a_clear_error(model_dir: Path) -> None:
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        create_backend(model_dir, kind="megakernel")
    with pytest.raises(BackendUnavailableError, match="backend must be one of"):
        create_backend(model_dir, kind="fast")
    assert create_backend(model_dir, kind="auto").name == "reference"  # auto falls back on the CPU
    with pytest.raises(BackendUnavailableError, match="drafts must be None, 'mtp' or 'lookup'"):
        create_backend(model_dir, drafts="ngram")


def test_the_engine_tells_the_back_end_where_its_drafts_come_from() -> None:
    """What create_backend hears (the megakernel's GEMV follows it: kernels/tuning.py tuning_from_env)."""
    from onestream.worker.engine import draft_source

    assert draft_source() == "mtp"  # the engine's defaults draft
    assert draft_source("combined", 2, None) == "mtp" and draft_source("mtp", 3, 0) == "mtp"
    assert draft_source("combined", 0, None) is None  # MTP drafts off turns the combined mode's off
    assert draft_source("lookup", 0, None) == "lookup" and draft_source("lookup", 2, 0) is None


def test_errors_live_in_errors_and_keep_their_old_import_paths() -> None:
    from onestream.worker import backend, engine, errors, state

    assert engine.EngineBusyError is errors.EngineBusyError
    assert backend.BackendUnavailableError is errors.BackendUnavailableError
    assert state.StateError is errors.StateError
    for cls in (errors.EngineBusyError, errors.BackendUnavailableError, errors.StateError):
        assert issubclass(cls, errors.OnestreamError)


class PreparingBackend(ReferenceBackend):
    """A reference back end that records what the engine asks it to prepare (the megakernel compiles)."""

    def __init__(self, model: object) -> None:
        super().__init__(model)
        self.prepared: list[int] = []

    def prepare(self, max_tokens: int, on_step: Callable[[int, int], None] | None = None) -> None:
        self.prepared.append(max_tokens)
        for n in range(1, max_tokens + 1):  # one build per tokens-per-launch, as kernels/backend.py does
            if on_step is not None:
                on_step(n, max_tokens)


def test_warm_up_prepares_the_launch_sizes_a_speculative_cycle_runs(model_dir: Path) -> None:
    backend = PreparingBackend(load_model(model_dir, dtype=torch.float32))
    engine = Engine(model_dir, backend=backend, spec_k=3, drafting="mtp")
    reports: list[ProgressReport] = []
    engine.warm_up(reports.append)
    assert backend.prepared == [4]  # a verify of 3 drafts is 4 tokens; first draft steps take up to 4 pairs
    # each build reported as a load reports its tensors: the card's `loading` fraction while it compiles
    assert [(r.stage, r.done_tensors, r.total_tensors) for r in reports] == [
        ("compiling kernels", n, 4) for n in range(1, 5)
    ]
    assert [r.fraction for r in reports] == [0.25, 0.5, 0.75, 1.0]
    engine.drafting = "combined"  # copies from the context draft up to lookup_k
    engine.lookup_k = 6
    engine.warm_up()
    assert backend.prepared == [4, 7]
    engine.spec_k = 0
    engine.warm_up()
    assert backend.prepared == [4, 7, 1]
    plain = Engine(model_dir, backend="reference", device="cpu", dtype="fp32")
    plain.warm_up()  # a back end with nothing to prepare: a no-op
    assert run(plain, GenerateRequest([1, 2, 3], GREEDY, max_tokens=3))[1].usage.generated_tokens == 3

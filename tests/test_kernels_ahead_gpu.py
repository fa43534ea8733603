"""Plain decoding one launch ahead of the host on the megakernel (GPU only): each step fed by the token the
previous one wrote on the device (or the sampler chose behind it), the same tokens as a decode that synchronises
every step, and a state that stays consistent when a stop ends the run with a step already queued."""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and cupy")]

if HAS_GPU:
    from onestream.kernels.backend import MegakernelBackend
    from onestream.kernels.runtime import MegakernelError
    from onestream.worker.api import GenerateRequest, SamplingParams
    from onestream.worker.engine import Engine, Finished, TokenChunk
    from onestream.worker.loading import default_model_dir, load_model

    class SyncedMegakernel(MegakernelBackend):
        decode_ahead = None  # the engine then synchronises every step (the path before the run-ahead)

    class CountingMegakernel(MegakernelBackend):
        """Counts the steps queued ahead of the host."""

        queued = 0

        def decode_ahead(self, input_ids, state):
            self.queued += 1
            return super().decode_ahead(input_ids, state)


GREEDY = SamplingParams(temperature=0.0) if HAS_GPU else None


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_dir(), dtype=torch.bfloat16, device="cuda")


def ids_and_end(engine, request):
    items = list(engine.generate(request))
    assert isinstance(items[-1], Finished)
    return [t for c in items[:-1] if isinstance(c, TokenChunk) for t in c.token_ids], items[-1]


def prompts(engine, n: int = 4) -> list[list[int]]:
    text = (default_model_dir().parent.parent / "engine.py").read_text()
    ids = engine.tokenizer.encode(text)
    return [ids[i * 301 : i * 301 + 40] for i in range(n)]


@torch.no_grad()
def test_run_ahead_equals_synced_steps_and_the_device_chain(model):
    ahead = Engine(default_model_dir(), backend=MegakernelBackend(model), spec_k=0)
    synced = Engine(default_model_dir(), backend=SyncedMegakernel(model), spec_k=0)
    runner = ahead.backend.runner
    for prompt in prompts(ahead):
        request = GenerateRequest(prompt, GREEDY, max_tokens=32, ignore_eos=True)
        got, _ = ids_and_end(ahead, request)
        assert got == ids_and_end(synced, request)[0]
        state = model.new_state(len(prompt) + 40)
        ahead.backend.prefill(torch.tensor(prompt[:-1], device="cuda"), state)  # the engine's prefill path
        chain = runner.greedy_chain(prompt[-1], state, 32)
        assert chain == got


@torch.no_grad()
def test_a_stop_leaves_the_queued_step_in_the_state(model):
    engine = Engine(default_model_dir(), backend=MegakernelBackend(model), spec_k=0)
    prompt = prompts(engine, 1)[0]
    free, _ = ids_and_end(engine, GenerateRequest(prompt, GREEDY, max_tokens=24, ignore_eos=True))
    stop = free[6]
    request = GenerateRequest(
        prompt, GREEDY, max_tokens=24, stop_token_ids=[stop], session_id="s", ignore_eos=True
    )
    got, end = ids_and_end(engine, request)
    assert end.finish_reason == "stop" and got == free[: free.index(stop) + 1]
    session = engine._sessions.take("s")
    engine._sessions.put(session)
    seq = session.sequence
    assert seq.tokens == prompt + got and seq.state.length == len(seq.tokens)
    follow = [*prompt, *got]
    again, _ = ids_and_end(
        engine, GenerateRequest(follow, GREEDY, max_tokens=12, session_id="s", ignore_eos=True)
    )
    fresh = Engine(default_model_dir(), backend=MegakernelBackend(model), spec_k=0)
    assert again == ids_and_end(fresh, GenerateRequest(follow, GREEDY, max_tokens=12, ignore_eos=True))[0]


@torch.no_grad()
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0, "repetition_penalty": 1.15},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 11},
        {"temperature": 1.0, "presence_penalty": 0.5, "seed": 12},
    ],
    ids=["repetition", "truncated-sample", "penalised-sample"],
)
def test_penalised_and_sampled_runs_ahead_equal_synced_steps(model, params):
    backend = CountingMegakernel(model)
    ahead = Engine(default_model_dir(), backend=backend, spec_k=0)
    synced = Engine(default_model_dir(), backend=SyncedMegakernel(model), spec_k=0)
    sampling = SamplingParams(**params)
    for prompt in prompts(ahead, 3):
        request = GenerateRequest(prompt, sampling, max_tokens=24, ignore_eos=True)
        before = backend.queued
        got, _ = ids_and_end(ahead, request)
        assert got == ids_and_end(synced, request)[0]
        assert backend.queued - before == 23  # every token after the first came from a queued step


@torch.no_grad()
def test_continuing_a_run_that_was_not_started_is_an_error(model):
    backend = MegakernelBackend(model)
    state = model.new_state(64)
    model.forward_step(torch.tensor([1, 2, 3], device="cuda"), state, logits="last")
    with pytest.raises(MegakernelError, match="continues a run"):
        backend.runner.decode_ahead(None, state)
    backend.runner.decode_ahead(torch.tensor([4], device="cuda"), state)
    backend.runner.step(torch.tensor([5], device="cuda"), state)  # another launch ends the run
    with pytest.raises(MegakernelError, match="continues a run"):
        backend.runner.decode_ahead(None, state)

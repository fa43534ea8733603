"""The sampler queues behind a step without waiting for the device (GPU only): a decode run ahead of the host
(`Sequence.decode_run`) stays ahead only if choosing and recording a token never synchronises. CUDA's sync debug
mode turns any synchronising call into an error."""

from __future__ import annotations

import pytest
import torch
from onestream.worker.api import SamplingParams
from onestream.worker.sampling import RequestSampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 248_320  # the 27B vocabulary: the sizes the run-ahead works on


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, repetition_penalty=1.15),
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=1),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.1, seed=2),
        SamplingParams(temperature=0.0, logit_bias=((5, 2.0), (17, -3.0))),
        SamplingParams(temperature=0.8, logit_bias=((5, 2.0),), repetition_penalty=1.1, seed=3),
    ],
    ids=["repetition", "presence-frequency", "top-k-top-p", "min-p-penalised", "logit-bias", "biased-sample"],
)
def test_choosing_a_token_never_synchronises(params: SamplingParams) -> None:
    prompt = torch.randint(0, VOCAB, (64,)).tolist()
    sampler = RequestSampler(params, prompt, VOCAB, "cuda")
    logits = torch.randn(1, VOCAB, device="cuda", dtype=torch.bfloat16)
    chosen = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            chosen.append(sampler.choose(logits))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = [int(t) for t in chosen]
    assert all(0 <= t < VOCAB for t in tokens)
    if sampler.history is not None:  # every chosen token was recorded as emitted
        assert int(sampler.history.output_counts.sum()) == 4
        assert bool(sampler.history.seen[torch.tensor(tokens, device="cuda")].all())

"""Time to first token of a second session that shares a long system prompt with a first one, against a
cold prefill of the same prompt: `python tools/prefix_sharing_ttft.py [--model DIR] [--chars N] [--rounds R]`.
The system prompt is the first N characters of worker/engine.py; each round uses new user messages."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from onestream.worker.api import SamplingParams
from onestream.worker.engine import Engine, GenerateRequest


def first_token(
    engine: Engine, messages: list[dict[str, str]], session: str | None
) -> tuple[float, int, int]:
    request = GenerateRequest(messages, SamplingParams(temperature=0.0), max_tokens=4, session_id=session)
    *_, finished = engine.generate(request)
    return (
        finished.timings.time_to_first_token_s,
        finished.usage.prompt_tokens,
        finished.usage.cached_prompt_tokens,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--chars", type=int, default=9000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = Engine(args.model, backend="reference", device="cpu")
    cold = Engine(args.model, backend=engine.backend, cache_bytes=0)  # caches nothing
    source = Path(__file__).resolve().parents[1] / "worker" / "engine.py"
    system = {"role": "system", "content": source.read_text()[: args.chars]}
    for i in range(args.rounds):
        first = [system, {"role": "user", "content": f"def task_{i}_a(x):"}]
        second = [system, {"role": "user", "content": f"def task_{i}_b(y):"}]
        cold_s, prompt, _ = first_token(cold, second, None)
        first_token(engine, first, f"first-{i}")
        warm_s, _, cached = first_token(engine, second, f"second-{i}")
        print(f"{prompt} prompt tokens: cold {cold_s:.3f} s; second session {warm_s:.3f} s ({cached} cached)")
        for session in (f"first-{i}", f"second-{i}"):
            engine.close_session(session)


if __name__ == "__main__":
    main()

"""Greedy completions of a few code prompts with the engine: a quick look at what a checkpoint writes.

    python -m tools.default_model.samples --model CKPT [--device cuda] [--max-tokens 48] [--out samples.json]
        [--backend reference]

Each prompt runs twice, with token healing as `onestream generate` does: plain greedy (temperature 0, no
penalties) and with the checkpoint's generation_config.json defaults (what `onestream generate` uses when
no sampling flag is given).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPTS = (
    "def fib(n):\n",
    "def fib(n):",  # ends mid-token (the corpus has "):\n"): token healing's case
    "import os\n",
    "class Stack:\n",
    "def read_lines(path):\n    with open(path) as f:\n",
    "for i in range(10):\n",
)


def completions(
    model: Path, device: str, max_tokens: int, backend: str = "reference", prompts: tuple[str, ...] = PROMPTS
) -> dict:
    from onestream.worker.api import GenerateRequest, SamplingParams
    from onestream.worker.engine import Engine, Finished

    engine = Engine(str(model), backend=backend, device=device, token_healing=True)  # as `generate` runs
    settings = {"greedy": SamplingParams(temperature=0.0), "model_defaults": engine.default_sampling()}
    records = []
    for prompt in prompts:
        record: dict = {"prompt": prompt}
        for name, params in settings.items():
            started = time.perf_counter()
            pieces, finished = [], None
            for item in engine.generate(GenerateRequest(prompt, params, max_tokens=max_tokens)):
                if isinstance(item, Finished):
                    finished = item
                else:
                    pieces.append(item.text)
            assert finished is not None
            record[name] = {
                "text": "".join(pieces),
                "tokens": finished.usage.generated_tokens,
                "finish_reason": finished.finish_reason,
                "seconds": time.perf_counter() - started,
            }
        records.append(record)
    return {
        "model": str(model),
        "device": str(engine.backend.device),
        "backend": engine.backend.name,
        "model_defaults": engine.generation_defaults,
        "max_tokens": max_tokens,
        "samples": records,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--backend", default="reference", help="reference | megakernel | auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = completions(args.model, args.device, args.max_tokens, args.backend)
    for record in result["samples"]:
        for name in ("greedy", "model_defaults"):
            print(f"--- {name}: {record['prompt']!r}\n{record['prompt']}{record[name]['text']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

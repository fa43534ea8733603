"""Evaluates a trained default model on this machine (CPU) and writes a JSON report.

    python -m tools.default_model.evaluate --model worker/assets/default_model --out report.json
    python -m tools.default_model.evaluate --export-prompts .data/default_model/spec_prompts

- speculative decoding on held-out files: `onestream eval spec` (the engine's own measurement: greedy,
  k = 1..4, acceptance per position, mean accepted length, tok/s with and without drafts);
- the time to generate 64 tokens from a code prompt with the default engine settings (what
  `onestream generate` does with no --model), plain and speculative;
- optionally, teacher-forced held-out loss of the shipped bf16 weights on a few windows (a check that the
  file here scores what training measured on the GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import REPO_ROOT, build_data, corpus

SPEC_FILES = 12  # held-out files to cut prompts from
SPEC_MIN_BYTES = 6_000
SPEED_PROMPT = '''import os


def read_lines(path):
    """Return the lines of a text file without their newlines."""
    with open(path) as f:
'''


def spec_files(count: int = SPEC_FILES) -> list[corpus.CorpusFile]:
    """A deterministic choice of held-out files long enough for several prompts."""
    candidates = [f for f in corpus.collect() if f.split == "heldout" and f.size >= SPEC_MIN_BYTES]
    candidates.sort(key=lambda f: hashlib.sha256(f.path.encode()).hexdigest())
    return candidates[:count]


def export_prompts(target: Path) -> list[str]:
    target.mkdir(parents=True, exist_ok=True)
    names = []
    for f in spec_files():
        name = f.path.replace("/", "__")
        (target / name).write_text(corpus.read_text(f))
        names.append(f.path)
    (target / "SOURCES.txt").write_text("\n".join(names) + "\n")
    return names


def run_spec_eval(model: Path, files: list[Path], extra: list[str], threads: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "onestream",
        "eval",
        "spec",
        "--model",
        str(model),
        "--json",
        "--backend",
        "reference",
        "--device",
        "cpu",
        *extra,
        *map(str, files),
    ]
    started = time.time()
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO_ROOT, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"onestream eval spec failed ({out.returncode}): {out.stderr[-2000:]}")
    record = json.loads(out.stdout)
    record["command"] = " ".join(command[2:]).replace(str(REPO_ROOT) + "/", "")
    record["wall_s"] = time.time() - started
    return record


def time_generate(model: Path, spec_k: int | None, repeats: int = 5) -> dict:
    """Median wall time of 64 tokens (prefill included) with the engine and the model's sampling defaults, as
    `onestream generate` runs it with no sampling flags."""
    from onestream.worker.api import GenerateRequest
    from onestream.worker.engine import Engine

    engine = Engine(str(model), device="cpu")
    if spec_k is not None:
        engine.spec_k = spec_k
    sampling = engine.default_sampling()
    request = GenerateRequest(SPEED_PROMPT, sampling, max_tokens=64, ignore_eos=True)
    times, text, usage = [], "", None
    for _ in range(repeats + 1):  # the first run pays one-time costs
        started = time.perf_counter()
        pieces = []
        for item in engine.generate(request):
            if hasattr(item, "text"):
                pieces.append(item.text)
            else:
                usage = item.usage
        times.append(time.perf_counter() - started)
        text = "".join(pieces)
    times = sorted(times[1:])
    return {
        "spec_k": engine.spec_k,
        "sampling": dataclasses.asdict(sampling),
        "median_s": times[len(times) // 2],
        "min_s": times[0],
        "generated_tokens": usage.generated_tokens if usage else None,
        "completion": text,
    }


def heldout_check(model_dir: Path, windows: int, seq_len: int) -> dict:
    from onestream.worker.loading import load_model

    from . import heldout

    data = build_data.DEFAULT_DATA
    meta = json.loads((data / "meta.json").read_text())
    stream = torch.from_numpy(build_data.read_tokens(data / "heldout.u16.xz").astype("int64"))
    model = load_model(model_dir, dtype=torch.bfloat16)
    bytes_per_token = meta["tokens"]["heldout"]["bytes"] / meta["tokens"]["heldout"]["tokens"]
    return heldout.evaluate(
        model,
        stream,
        seq_len=seq_len,
        batch=1,
        depths=3,
        bytes_per_token=bytes_per_token,
        max_windows=windows,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=REPO_ROOT / "worker/assets/default_model")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--export-prompts", type=Path, help="only copy the spec-eval files into this folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-prompts", type=int, default=32)
    parser.add_argument("--heldout-windows", type=int, default=0, help="CPU teacher-forced check (0: skip)")
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.export_prompts:
        print("\n".join(export_prompts(args.export_prompts)))
        return
    torch.set_num_threads(args.threads)
    prompts_dir = Path("/tmp/onestream_default_model_spec")
    shutil.rmtree(prompts_dir, ignore_errors=True)
    sources = export_prompts(prompts_dir)
    files = sorted(p for p in prompts_dir.iterdir() if p.suffix == ".py")
    report: dict = {
        "model": str(args.model),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": args.threads,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "spec_files": sources,
    }
    report["spec"] = run_spec_eval(args.model, files, ["--max-prompts", str(args.max_prompts)], args.threads)
    report["generate_64"] = {
        "plain": time_generate(args.model, 0),
        "default": time_generate(args.model, None),
    }
    if args.heldout_windows:
        report["heldout_cpu_check"] = heldout_check(args.model, args.heldout_windows, args.seq_len)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

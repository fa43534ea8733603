"""KLD of decoding after each prefill path against the fp32 reference, on the GPU.

    python3 tools/gpu/prefill_kld.py --json OUT.json [--budget-s 100]

Two models: the embedded model (trained weights, so that its distributions are those of a real model) on a
prompt of this repository's own Python source, and a 27B-shaped model with 4 layers and random weights. For
each, the fp32 reference prefills the prompt and decodes greedily (the ground truth); then each bf16 case
prefills the same prompt and decodes the same tokens (teacher forced), and its logits are compared row by
row with the truth: the bf16 reference, the fast prefill with each delta-rule kernel, each followed by the
reference's decode or the megakernel's. The bf16 reference's own distance is the scale for the others.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from onestream.kernels.random_model import config_27b, random_model
from onestream.worker.loading import default_model_dir, load_model
from onestream.worker.prefill import FastPrefill
from onestream.worker.prefill.deltanet import _fla_function

ROWS = 24  # decode rows compared after the prompt


def kld(truth: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    p = truth.float().log_softmax(-1)
    return (p.exp() * (p - other.float().log_softmax(-1))).sum(-1)


def source_prompt(n: int) -> torch.Tensor:
    """The first n tokens of this repository's worker/ sources under the embedded model's tokenizer."""
    from onestream.worker.checkpoints import open_checkpoint

    tokenizer = open_checkpoint(default_model_dir()).tokenizer()
    import onestream.worker

    worker = Path(onestream.worker.__file__).parent
    text = "\n\n".join(p.read_text() for p in sorted(worker.rglob("*.py")))
    ids = tokenizer.encode(text)[:n]
    return torch.tensor(ids, device="cuda")


def decode_rows(
    step: Callable[[torch.Tensor], torch.Tensor], first: torch.Tensor, fed: list[int]
) -> torch.Tensor:
    rows, logits = [], first
    for token in fed:
        rows.append(logits[-1].float())
        logits = step(torch.tensor([token], device="cuda"))
    return torch.stack(rows)


def truth(fp32: Any, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    state = fp32.new_state(len(ids) + ROWS + 1)
    logits = fp32.forward_step(ids, state, logits="last").logits
    rows, fed = [], []
    for _ in range(ROWS):
        rows.append(logits[-1].float())
        fed.append(int(logits[-1].argmax()))
        logits = fp32.forward_step(torch.tensor([fed[-1]], device="cuda"), state).logits
    return torch.stack(rows), fed


def run_model(
    name: str,
    model: Any,
    ids: torch.Tensor,
    out: dict[str, Any],
    left: Callable[[], float],
    *,
    fla_after_s: float,
    megakernel: bool,
) -> None:
    """The cases on one model: fla only with `fla_after_s` seconds of budget left (its Triton kernels compile and
    tune per head count), the megakernel's decode if `megakernel`."""
    fp32 = copy.deepcopy(model).float()
    want, fed = truth(fp32, ids)
    del fp32
    torch.cuda.empty_cache()
    results = out.setdefault(name, {"prompt_tokens": len(ids), "rows": ROWS})

    def record(label: str, got: torch.Tensor) -> None:
        value = kld(want, got)
        results[label] = {
            "kld_mean": float(value.mean()),
            "kld_max": float(value.max()),
            "same_top1": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        }
        print(f"[{name}] {label}: {json.dumps(results[label])}", flush=True)

    def reference_prefill(state: Any) -> torch.Tensor:
        return model.forward_step(ids, state, logits="last").logits

    prefills: dict[str, Callable[[Any], torch.Tensor]] = {"reference prefill": reference_prefill}
    kernels = ["torch", "fla"] if _fla_function() is not None else ["torch"]
    for kernel in kernels:
        if kernel == "fla" and left() < fla_after_s:
            results["fla"] = "skipped: time budget"
            break
        t0 = time.perf_counter()
        fast = FastPrefill(model, deltanet=kernel)  # fla: compiles and tunes its kernels in the probe
        results[f"setup s, {kernel}"] = time.perf_counter() - t0
        prefills[f"fast prefill ({fast.description})"] = lambda state, fast=fast: fast(ids, state).logits
    for label, prefill in prefills.items():
        state = model.new_state(len(ids) + ROWS + 1)
        first = prefill(state)
        record(
            f"{label}, reference decode",
            decode_rows(lambda t, s=state: model.forward_step(t, s).logits, first, fed),
        )
    if not megakernel or left() < 25:
        return
    from onestream.kernels.backend import MegakernelBackend

    backend = MegakernelBackend(model, prefill="reference")
    for label, prefill in prefills.items():
        state = backend.new_state(len(ids) + ROWS + 1)
        first = prefill(state)
        record(
            f"{label}, megakernel decode",
            decode_rows(lambda t, s=state: backend.decode(t, s).logits, first, fed),
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--budget-s", type=float, default=100.0)
    parser.add_argument("--prompt", type=int, default=3000)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_kld: needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.perf_counter()

    def left() -> float:
        return args.budget_s - (time.perf_counter() - started)

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with torch.no_grad():
        embedded = load_model(default_model_dir(), dtype=torch.bfloat16, device="cuda")
        run_model(
            "embedded model", embedded, source_prompt(args.prompt), out, left, fla_after_s=0, megakernel=True
        )
        del embedded
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=1))
        if left() > 20:
            model = random_model(config_27b(4), seed=2024)
            gen = torch.Generator(device="cuda").manual_seed(5)
            ids = torch.randint(0, model.config.vocab_size, (args.prompt,), device="cuda", generator=gen)
            name = "27B shapes, 4 layers, random weights"
            run_model(name, model, ids, out, left, fla_after_s=70, megakernel=False)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

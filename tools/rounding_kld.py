"""How much a model amplifies bf16 roundings of its activations, on the CPU: teacher-forced KLD against the fp32
reference of (a) the fp32 reference with every linear layer's input rounded to bf16 -- the megakernel's GEMV inputs
are staged in bf16 even in its fp32-activation build --, (b) those inputs then quantized per 32 as the quantized
GEMV's dp4a path does (two int8 planes, 15 bits of the unit's largest) and as a single int8 plane would (8 bits,
llama.cpp's q8_1), and two planes over wider groups (per 128 and per whole row: a tensor-core GEMV that applies a
K-quant's sub-block scales in integers needs one input scale per 256), and (c) the whole model in bf16.

Neither side involves the megakernel; the figures tell a model that amplifies roundings (a badly conditioned random
model) from a kernel that makes too many. Both sides run the same weights (`--quantize` or a GGUF: the same
quantized weights, dequantized).

    python tools/rounding_kld.py [--model DIR|FILE] [--quantize PRESET] [--tokens FILE | --text FILE ...] [--limit 2048]
        [--ctx 512]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.evaluation import ReferenceForward, read_token_file, run_kld
from onestream.worker.loading import load_model

DEFAULT_TOKENS = Path(".data/eval/heldout_tokens.txt")


def quantize_units(x: torch.Tensor, top: int, unit: int = 32) -> torch.Tensor:
    """x rounded to bf16 (as the kernel stages it), then to integers per `unit` consecutive inputs (0: the whole
    input row) with the unit's largest |x| at `top` (127: one int8 plane, as llama.cpp's q8_1; 32639: the
    megakernel's two int8 planes, x = d (256 q1 + q2)), and back."""
    x = x.bfloat16().float()
    width = x.shape[-1]
    unit = unit or width
    padded = F.pad(x, (0, -width % unit))  # a row that is not whole units ends in a shorter one
    units = padded.reshape(*x.shape[:-1], -1, unit)
    d = units.abs().amax(-1, keepdim=True) / top
    q = torch.where(d > 0, torch.round(units / d.clamp_min(1e-30)), torch.zeros_like(units))
    return (q * d).reshape(padded.shape)[..., :width]


class TransformedInputs(ReferenceForward):
    """The reference with the input of every `F.linear` (projections, lm_head) passed through `transform` first."""

    def __init__(self, model: Any, name: str, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(model, name)
        self.transform = transform

    def logits(self, window: Sequence[int]) -> torch.Tensor:
        linear = F.linear
        F.linear = lambda x, w, b=None: linear(self.transform(x), w, b)
        try:
            return super().logits(window)
        finally:
            F.linear = linear


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="checkpoint directory or .gguf (default: the embedded model)"
    )
    parser.add_argument("--quantize", default=None, help="quantize on load (both sides)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tokens", type=Path, default=DEFAULT_TOKENS)
    source.add_argument(
        "--text",
        type=Path,
        nargs="+",
        help="text files, one after another, tokenized with the model's tokenizer",
    )
    parser.add_argument("--limit", type=int, default=2048)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = open_checkpoint(args.model, quantize=args.quantize)
    if args.text:
        tokens = checkpoint.tokenizer().encode("".join(path.read_text() for path in args.text))[: args.limit]
    else:
        tokens = read_token_file(args.tokens)[: args.limit]
    fp32 = load_model(checkpoint, dtype=torch.float32, device="cpu")
    ref = ReferenceForward(fp32, "fp32")
    rows = [
        (
            "fp32, linear inputs rounded to bf16",
            run_kld(
                TransformedInputs(fp32, "rounded", lambda x: x.bfloat16().float()), ref, tokens, args.ctx
            ),
        )
    ]
    for label, top, unit in (
        ("two int8 planes (15 bits, the kernel's) per 32", 32639, 32),
        ("one int8 plane (q8_1-like) per 32", 127, 32),
        ("two int8 planes per 128", 32639, 128),
        ("two int8 planes per whole input row", 32639, 0),
    ):
        transform = partial(quantize_units, top=top, unit=unit)
        rows.append(
            (
                f"fp32, linear inputs in bf16 then {label}",
                run_kld(TransformedInputs(fp32, label, transform), ref, tokens, args.ctx),
            )
        )
    bf16 = load_model(checkpoint, dtype=torch.bfloat16, device="cpu")
    rows.append(("bf16 model", run_kld(ReferenceForward(bf16, "bf16"), ref, tokens, args.ctx)))
    print(
        f"{checkpoint.path} ({args.quantize or checkpoint.format.label}), against fp32, {rows[0][1].positions} positions"
    )
    print("| side | mean KLD | same top-1 | max abs logit diff | PPL (fp32) |")
    print("|---|---|---|---|---|")
    for name, s in rows:
        print(
            f"| {name} | {s.mean_kld:.3e} | {s.same_top1_pct:.2f} % | {s.max_abs_logit_diff:.3f} | {s.ppl_ref:.4g} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a smaller KV cache would cost in accuracy, on the CPU: teacher-forced KLD against the fp32 reference of the
same reference with every attention layer's keys (normed, rotated) and values stored at a lower precision and read
back: bf16 (what the megakernel and the bf16 engine store today), fp8 e4m3 and e5m2 as they are, fp8 e4m3 and int8
with one scale per (head, position) vector, and int4 with one scale per 32 values.

The long-context decode targets of issue 24 ask more of the Q4_K_M engine than its bytes allow with a bf16 cache
(`bench decode --context` prints the bound): the cache's bytes, not the kernel, decide them. Rounding the keys and
values where they are made is what a cache of that precision does to every later read (the positions of the same
launch included, as a kernel that rounds its new keys before attending to them would).

    python tools/kv_cache_kld.py [--model DIR|FILE] [--quantize PRESET] [--tokens FILE | --text FILE ...]
        [--files N] [--limit 4096] [--ctx 1024]

Without --tokens or --text it reads the embedded model's held-out corpus files found on this machine (the first
--files of them in the list's order).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.evaluation import KLDStats, ReferenceForward, read_token_file, run_kld
from onestream.worker.layers.attention import GatedAttention
from onestream.worker.loading import load_model
from onestream.worker.workloads import heldout_files

Rounding = Callable[[torch.Tensor], torch.Tensor]


def fp8(x: torch.Tensor, dtype: torch.dtype, *, scaled: bool) -> torch.Tensor:
    """x through an fp8 format and back: as it is (saturating at the format's largest), or with one scale per
    vector of the last dimension (its largest |x| at the format's largest)."""
    top = torch.finfo(dtype).max
    if not scaled:
        return x.clamp(-top, top).to(dtype).float()
    s = (x.abs().amax(-1, keepdim=True) / top).clamp_min(1e-30)
    return (x / s).to(dtype).float() * s


def integers(x: torch.Tensor, bits: int, group: int = 0) -> torch.Tensor:
    """x rounded to signed integers of `bits` bits with one absmax scale per `group` values of the last dimension
    (0: the whole vector), and back."""
    top = 2 ** (bits - 1) - 1
    shape = x.shape
    g = x.reshape(*shape[:-1], -1, group or shape[-1])
    s = (g.abs().amax(-1, keepdim=True) / top).clamp_min(1e-30)
    return (torch.round(g / s).clamp(-top, top) * s).reshape(shape)


ROUNDINGS: dict[str, Rounding] = {
    "bf16 (today's cache)": lambda x: x.bfloat16().float(),
    "fp8 e4m3, unscaled": lambda x: fp8(x, torch.float8_e4m3fn, scaled=False),
    "fp8 e5m2, unscaled": lambda x: fp8(x, torch.float8_e5m2, scaled=False),
    "fp8 e4m3, a scale per head vector": lambda x: fp8(x, torch.float8_e4m3fn, scaled=True),
    "int8, a scale per head vector": lambda x: integers(x, 8),
    "int4, a scale per 32 values": lambda x: integers(x, 4, 32),
}


@contextlib.contextmanager
def cache_rounded(rounding: Rounding) -> Iterator[None]:
    """Every attention layer's keys and values rounded where they are made (GatedAttention._heads)."""
    heads = GatedAttention._heads

    def rounded(self: GatedAttention, *args: Any) -> tuple[torch.Tensor, ...]:
        q, k, v, gate = heads(self, *args)
        return q, rounding(k.float()).to(k.dtype), rounding(v.float()).to(v.dtype), gate

    GatedAttention._heads = rounded  # type: ignore[method-assign]
    try:
        yield
    finally:
        GatedAttention._heads = heads  # type: ignore[method-assign]


class RoundedCache(ReferenceForward):
    def __init__(self, model: Any, name: str, rounding: Rounding) -> None:
        super().__init__(model, name)
        self.rounding = rounding

    def logits(self, window: Sequence[int]) -> torch.Tensor:
        with cache_rounded(self.rounding):
            return super().logits(window)


def read_tokens(args: argparse.Namespace, checkpoint: Any) -> list[int]:
    if args.tokens:
        return read_token_file(args.tokens)[: args.limit]
    if args.text:
        texts = [path.read_text() for path in args.text]
    else:
        files, _ = heldout_files(checkpoint.path, min_bytes=4096)
        if not files:
            raise SystemExit(
                "none of the model's held-out corpus files is on this machine: give --text or --tokens"
            )
        texts = [f.text for f in files[: args.files]]
    tokens: list[int] = []
    for text in texts:
        tokens += checkpoint.tokenizer().encode(text)
    return tokens[: args.limit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="checkpoint directory or .gguf (default: the embedded model)"
    )
    parser.add_argument("--quantize", default=None, help="quantize on load (both sides)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tokens", type=Path, default=None, help="whitespace-separated token ids")
    source.add_argument(
        "--text", type=Path, nargs="+", help="text files, tokenized with the model's tokenizer"
    )
    parser.add_argument("--files", type=int, default=24, help="held-out corpus files read (default source)")
    parser.add_argument("--limit", type=int, default=4096)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = open_checkpoint(args.model, quantize=args.quantize)
    tokens = read_tokens(args, checkpoint)
    model = load_model(checkpoint, dtype=torch.float32, device="cpu")
    ref = ReferenceForward(model, "fp32 cache")
    rows: list[tuple[str, KLDStats]] = []
    for label, rounding in ROUNDINGS.items():
        rows.append((label, run_kld(RoundedCache(model, label, rounding), ref, tokens, args.ctx)))
        print(f"  {label}: {rows[-1][1].mean_kld:.3e}", flush=True)
    print(
        f"{checkpoint.path} ({args.quantize or checkpoint.format.label}), fp32 model, keys and values stored at each "
        f"precision against an fp32 cache, {rows[0][1].positions} positions in windows of {args.ctx}"
    )
    print("| cache | mean KLD | 99.9% KLD | same top-1 | max abs logit diff | PPL (fp32 cache) |")
    print("|---|---|---|---|---|---|")
    for name, s in rows:
        print(
            f"| {name} | {s.mean_kld:.3e} | {s.kld_percentiles.get('99.9%', float('nan')):.3e} | "
            f"{s.same_top1_pct:.2f} % | {s.max_abs_logit_diff:.3f} | {s.ppl_ref:.4g} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

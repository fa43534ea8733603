"""`onestream eval`: check an implementation against a reference (kld), measure speculative decoding (spec)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .generate import add_engine_arguments, add_format_arguments, engine_format_options

DEFAULT_K_VALUES = (1, 2, 3, 4)
# Kept here (not imported from worker/) so that `onestream --help` does not load torch.
WORKLOADS = ("complete", "edit", "mixed")
DRAFTING_MODES = ("mtp", "lookup", "combined")
WORKLOAD_DRAFTING = ("mtp", "lookup", "combined")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="KL divergence against a reference; speculative decoding stats"
    )
    sub = parser.add_subparsers(dest="eval_command", metavar="WHAT")
    sub.required = True

    kld = sub.add_parser(
        "kld", help="teacher-forced KL divergence against a reference (llama.cpp statistics)"
    )
    add_engine_arguments(kld)
    kld.add_argument(
        "--against",
        required=True,
        help="hf (transformers on the same checkpoint), reference (our PyTorch model on the same checkpoint and "
        "--quantize preset), or another model in any format (a checkpoint DIR, a .gguf file; --against-quantize "
        "for a quantized variant)",
    )
    add_format_arguments(kld, prefix="against-")
    source = kld.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", type=Path, help="file of whitespace-separated token ids")
    source.add_argument("--text", type=Path, help="text file, tokenized with the model's tokenizer")
    kld.add_argument("--ctx", type=int, default=512, help="window length: each window starts at position 0")
    kld.add_argument("--limit", type=int, default=None, help="score at most this many tokens")
    kld.add_argument("--against-dtype", default="fp32", help="dtype of the reference side (default fp32)")
    kld.add_argument(
        "--steps",
        action="store_true",
        help="run the tested side one decode step per token (always for megakernel)",
    )
    kld.add_argument("--json", action="store_true", help="print the statistics as JSON")
    kld.set_defaults(func=_reporting_errors(run_kld, "kld"))

    spec = sub.add_parser(
        "spec", help="speculative decoding (MTP, prompt lookup): acceptance and speed on held-out prompts"
    )
    add_engine_arguments(spec)
    spec.add_argument(
        "files",
        nargs="*",
        type=Path,
        metavar="FILE",
        help="text files to cut prompts from (with --workload, default: the model's held-out corpus files)",
    )
    spec.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=None,
        help="agent-like prompts: complete (continue code), edit (write a file back with a change), "
        "mixed (both by turns); default: plain continuation prompts, MTP drafting",
    )
    spec.add_argument(
        "--drafting",
        nargs="+",
        choices=DRAFTING_MODES,
        default=None,
        help="draft sources to measure (default: mtp; with --workload: mtp lookup combined)",
    )
    spec.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=None,
        help="MTP drafts per cycle to try (default: 1 2 3 4; with --workload: the engine's)",
    )
    spec.add_argument("--lookup-k", type=int, default=None, help="most drafts a lookup cycle copies")
    spec.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="greedy MTP drafts among the first N token ids only (default: learnt from the output, "
        "worker/draft_vocab.py; 0: the whole vocabulary)",
    )
    spec.add_argument(
        "--ngram",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="n-gram lengths the lookup matches",
    )
    spec.add_argument(
        "--fixed-length",
        action="store_true",
        help="copy the lookup's most tokens every cycle (no adaptive length)",
    )
    spec.add_argument(
        "--no-extend-mtp",
        action="store_true",
        help="combined: do not continue an MTP draft with a copy from the context",
    )
    spec.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt")
    spec.add_argument("--prompts-per-file", type=int, default=4)
    spec.add_argument("--max-prompts", type=int, default=32)
    spec.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    spec.add_argument("--json", action="store_true", help="print the results as JSON")
    spec.set_defaults(func=_reporting_errors(run_spec, "spec"))


def _reporting_errors(
    command: Callable[[argparse.Namespace], int], name: str
) -> Callable[[argparse.Namespace], int]:
    """Bad input (checkpoint, files, options) ends with one line naming it, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        from onestream.worker.errors import OnestreamError

        try:
            return command(args)
        except (OnestreamError, ValueError, OSError) as e:
            print(f"onestream eval {name}: {e}", file=sys.stderr)
            return 2

    return run


def _dtype(name: str | None) -> Any:
    from onestream.worker.engine import parse_dtype

    return parse_dtype(name)


def run_kld(args: argparse.Namespace) -> int:
    import torch

    from onestream.worker.backend import create_backend
    from onestream.worker.checkpoints import open_checkpoint
    from onestream.worker.evaluation import (
        BackendSteps,
        ReferenceForward,
        TransformersForward,
        read_token_file,
        reference_source,
        run_kld,
    )
    from onestream.worker.loading import load_model

    checkpoint = open_checkpoint(args.model, **engine_format_options(args))
    backend = create_backend(
        checkpoint, kind=args.backend, device=args.device, dtype=_dtype(args.dtype), kv_cache=args.kv_cache
    )
    device = backend.device
    if args.tokens is not None:
        tokens = read_token_file(args.tokens)
    else:
        tokens = checkpoint.tokenizer().encode(args.text.read_text())
    if args.limit is not None:
        tokens = tokens[: args.limit]
    bad = [t for t in tokens if not 0 <= t < backend.config.vocab_size]
    if bad:
        print(f"onestream eval kld: token id {bad[0]} is outside the vocabulary", file=sys.stderr)
        return 2
    test = BackendSteps(backend) if args.steps else reference_source(backend)
    ref_dtype = _dtype(args.against_dtype) or torch.float32
    if args.against == "hf":
        ref: Any = TransformersForward(checkpoint.path, device=device, dtype=ref_dtype)
    else:
        same = args.against == "reference"
        # `reference` runs the same weights: a --quantize preset applies to it too unless --against-quantize says
        # otherwise (the megakernel's bar is the fp32 reference on the same quantized weights).
        quantize = args.against_quantize
        if same and quantize is None:
            quantize = args.quantize
        against = open_checkpoint(
            checkpoint.path if same else Path(args.against),
            quantize=quantize,
            tokenizer_dir=args.against_tokenizer,
        )
        if against.config.vocab_size != backend.config.vocab_size:
            print(
                f"onestream eval kld: {against.path} has a vocabulary of {against.config.vocab_size}, "
                f"{checkpoint.path} of {backend.config.vocab_size}: they cannot be compared",
                file=sys.stderr,
            )
            return 2
        name = "reference" if same else f"{against.name} [{against.format.label}]"
        ref = ReferenceForward(
            load_model(against, dtype=ref_dtype, device=device), name=f"{name} ({args.against_dtype})"
        )
    stats = run_kld(test, ref, tokens, args.ctx)
    print(json.dumps(stats.as_dict(), indent=2) if args.json else stats.format())
    return 0


def run_spec(args: argparse.Namespace) -> int:
    from onestream.worker.draft_vocab import check_draft_vocab
    from onestream.worker.engine import Engine
    from onestream.worker.evaluation import SpeculativeMismatchError, cut_prompts, time_runs

    engine = Engine(
        args.model,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        kv_cache=args.kv_cache,
        **engine_format_options(args),
    )
    draftings = args.drafting or list(WORKLOAD_DRAFTING if args.workload else ("mtp",))
    needs_mtp = [d for d in draftings if d != "lookup"]
    if needs_mtp and not engine.backend.has_mtp:
        print(
            f"onestream eval spec: this model has no MTP head (drafting {needs_mtp[0]}; lookup works)",
            file=sys.stderr,
        )
        return 2
    ks = args.k or ([engine.spec_k] if args.workload else list(DEFAULT_K_VALUES))
    if args.lookup_k is not None:
        engine.lookup_k = args.lookup_k
    if args.draft_vocab is not None:  # fixed instead of learnt from the output
        vocab = args.draft_vocab or None
        check_draft_vocab(vocab, engine.backend.config.vocab_size)
        engine.backend.draft_vocab, engine.draft_vocabulary = vocab, None
    if args.ngram is not None:
        engine.ngram = tuple(args.ngram)
    engine.adaptive_drafts = not args.fixed_length
    engine.extend_mtp = not args.no_extend_mtp
    if args.workload:
        prompts, described = _workload_prompts(engine, args)
    else:
        if not args.files:
            print("onestream eval spec: give FILES to cut prompts from (or --workload)", file=sys.stderr)
            return 2
        token_lists = [engine.tokenizer.encode(path.read_text(errors="replace")) for path in args.files]
        prompts = cut_prompts(
            token_lists,
            prompt_tokens=args.prompt_tokens,
            per_source=args.prompts_per_file,
            room=args.max_tokens,
        )[: args.max_prompts]
        described = f"{len(prompts)} prompts of {args.prompt_tokens} tokens"
    if not prompts:
        print(
            f"onestream eval spec: no file has {args.prompt_tokens + args.max_tokens} tokens to cut a prompt from",
            file=sys.stderr,
        )
        return 2
    try:
        runs = time_runs(engine, prompts, ks, args.max_tokens, draftings)
    except SpeculativeMismatchError as e:
        print(f"onestream eval spec: FAILED: {e}", file=sys.stderr)
        return 1
    plain = runs[0]
    best = max(runs[1:], key=lambda r: r.tokens_per_s)
    info = engine.model_info()
    if args.json:
        record = {
            "model": info,
            "workload": args.workload,
            "prompts": len(prompts),
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "lookup_k": engine.lookup_k,
            "draft_vocab": engine.backend.draft_vocab,
            "ngram": list(engine.ngram),
            "adaptive": engine.adaptive_drafts,
            "extend_mtp": engine.extend_mtp,
            "outputs_identical": True,
            "plain": plain.as_dict(),
            "speculative": [r.as_dict() | {"speedup": r.tokens_per_s / plain.tokens_per_s} for r in runs[1:]],
            "best_k": best.k,
            "best_drafting": best.drafting,
        }
        print(json.dumps(record, indent=2))
        return 0
    print(
        f"{info['model_name']} [{info['format']}] on {info['backend']} {info['device']} {info['dtype']}: {described}, "
        f"{args.max_tokens} greedy tokens each; speculative outputs identical to plain"
    )
    print(
        f"{'drafting':>8} {'k':>3} {'tok/s':>9} {'speedup':>8} {'cpu tok/s':>9} {'verifies':>9} {'drafted':>8} {'accepted':>9} "
        f"{'mean len':>9} {'tok/pass':>9}  per position  [by source: cycles, mean len]"
    )
    print(
        f"{'plain':>8} {'-':>3} {plain.tokens_per_s:9.1f} {1.0:8.2f} {plain.tokens_per_cpu_s:9.1f} {'-':>9} {'-':>8} {'-':>9} {'1.00':>9} "
        f"{'1.00':>9}  ({plain.generated_tokens} tokens)"
    )
    for r in runs[1:]:
        per_position = " ".join(f"{a:.2f}" for a in r.acceptance_per_position())
        sources = ", ".join(
            f"{source} {c.drafts} {c.mean_accepted_length:.2f}" for source, c in sorted(r.by_source.items())
        )
        k = "-" if r.drafting == "lookup" else str(r.k)
        print(
            f"{r.drafting:>8} {k:>3} {r.tokens_per_s:9.1f} {r.tokens_per_s / plain.tokens_per_s:8.2f} "
            f"{r.tokens_per_cpu_s:9.1f} {r.drafts:9d} "
            f"{r.draft_tokens:8d} {r.accepted_tokens:9d} {r.mean_accepted_length:9.2f} {r.tokens_per_pass:9.2f}  "
            f"{per_position}  [{sources}]"
        )
    print(f"fastest: k={'-' if best.drafting == 'lookup' else best.k} ({best.drafting})")
    return 0


def _workload_prompts(engine: Any, args: argparse.Namespace) -> tuple[list[list[int]], str]:
    """The --workload prompts (from FILES, or the model's held-out corpus files) and a line saying what
    they are."""
    from onestream.worker.workloads import SourceFile, build_prompts, heldout_files

    if args.files:
        sources = [SourceFile(str(p), p.read_text(errors="replace")) for p in args.files]
        origin = f"{len(sources)} files given"
    else:
        sources, listed = heldout_files(engine.model_dir)
        if not sources:
            raise FileNotFoundError(
                f"none of the {listed} held-out files of {engine.model_dir}'s corpus list is on this machine "
                "with its recorded content: give FILES"
            )
        origin = f"{len(sources)} of the model's {listed} held-out corpus files found here"
    prompts = build_prompts(
        args.workload,
        sources,
        engine.tokenizer,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        per_source=args.prompts_per_file,
        max_prompts=args.max_prompts,
    )
    kinds = sorted({p.kind for p in prompts})
    described = (
        f"workload {args.workload}: {len(prompts)} prompts ({'/'.join(kinds)}) from {origin}, "
        f"{len({p.source for p in prompts})} files used"
    )
    return [p.ids for p in prompts], described

"""`onestream bench decode`: decode speed of the megakernel against the reference model (eager and in a CUDA
graph) and transformers' `generate`, on the 27B shapes (random bf16 weights) and on a small model, with the
copy and streaming-read bandwidth of the GPU measured in the same run. `onestream bench spec`: the cost of
speculative decoding on the megakernel (SPEC_DOC below). Both need a CUDA GPU and CuPy. `onestream bench load`: the
peak host memory of one model load against its files' size (CPU; bench_load.py)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from .generate import KV_CACHE_CHOICES


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks (decode and spec: GPU; load: CPU)", description=__doc__
    )
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True
    decode = sub.add_parser(
        "decode", help="decode tok/s and bandwidth, megakernel vs baselines", description=__doc__
    )
    decode.add_argument(
        "--layers", type=int, default=64, help="layers of the 27B-shaped model (64 = the real depth)"
    )
    decode.add_argument(
        "--context",
        type=_contexts,
        default=[64],
        metavar="N[,N...]",
        help="prompt tokens before decoding (default 64); several (e.g. 512,8192,32768,131072): instead of the "
        "baselines, the megakernel at each context (random KV caches of that length), with the ratio to the "
        "shortest, for bf16 and each --weights format (and each --variant build)",
    )
    decode.add_argument(
        "--kv-cache",
        type=_kv_formats,
        default=["auto"],
        metavar="FORMAT[,FORMAT...]",
        help="with several --context lengths: the KV cache formats to time, each against its own shortest "
        "context (auto: the model's dtype; int8: levels and a scale per head vector), e.g. auto,int8",
    )
    decode.add_argument("--steps", type=int, default=64, help="decode steps timed for the megakernel")
    decode.add_argument("--ref-steps", type=int, default=16, help="decode steps timed for the baselines")
    decode.add_argument(
        "--small-model", default=None, help="checkpoint dir of the small model (default: tiny test config)"
    )
    decode.add_argument("--skip-27b", action="store_true", help="only the small model")
    decode.add_argument("--skip-hf", action="store_true", help="leave out transformers' generate")
    decode.add_argument(
        "--sweep",
        action="store_true",
        help="also time the tensor-core GEMV and the per-phase timing build of the default kernel",
    )
    decode.add_argument(
        "--variant",
        action="append",
        default=[],
        type=_variant,
        metavar="LABEL:KEY=VALUE,...",
        help="also time a build with these Tuning fields changed, e.g. 'no idle prefetch:pf_idle_bytes=0' "
        "(repeatable; phase_timing=1 makes it a per-phase timing build)",
    )
    decode.add_argument(
        "--alternate",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also time the builds that are not timing builds (the default, the tensor-core GEMV with --sweep, "
        "each --variant) against each other on the 27B shapes, one chain each per round in rotating order, to "
        "separate their difference from run-to-run spread",
    )
    decode.add_argument(
        "--weights",
        type=_weights_list,
        default=None,
        metavar="FORMAT[,FORMAT...]",
        help="instead of the baselines: the megakernel per weights format on the 27B shapes (bf16, or a "
        f"quantization preset: {', '.join(WEIGHT_PRESETS)}; random blocks typed by the preset's rule), with "
        "bytes per token, the share of the read ceiling and the ratio to bf16 (timed too when not named)",
    )
    decode.add_argument("--json", default=None, help="write the results to this JSON file")
    decode.set_defaults(func=run_decode)
    _add_spec(sub)
    from .bench_load import add_parser as add_load

    add_load(sub)


WEIGHT_PRESETS = ("q4_k_m", "q5_k_m", "q6_k", "q8_0")


def _contexts(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(
            f"contexts are distinct positive token counts separated by commas, got {text!r}"
        )
    return values


def _kv_formats(text: str) -> list[str]:
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not names or any(n not in KV_CACHE_CHOICES for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"KV cache formats are distinct names among {', '.join(KV_CACHE_CHOICES)} separated by commas, "
            f"got {text!r}"
        )
    return names


def run_contexts(args: argparse.Namespace, tuning: Any, ceilings: Any, device: str) -> int:
    from onestream.kernels.bench_context import bench_contexts, contexts_json, format_contexts
    from onestream.kernels.random_model import config_27b

    formats = ["bf16", *[w for w in (args.weights or []) if w != "bf16"]]
    name = f"27B shapes ({args.layers} of 64 layers)" if args.layers != 64 else "27B shapes"
    rows = bench_contexts(
        config_27b(args.layers),
        formats,
        args.context,
        steps=args.steps,
        tuning=tuning,
        variants=dict(args.variant),
        kv_caches=tuple(args.kv_cache),
    )
    print(f"device: {device}")
    print(
        f"measured ceilings: copy {ceilings.copy_gbs:.0f} GB/s (read+write), read {ceilings.read_gbs:.0f} GB/s"
    )
    print(format_contexts(ceilings, rows, name), flush=True)
    if args.json:
        record = {"device": device, "layers": args.layers, **contexts_json(ceilings, rows)}
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0 if all(r.tok_s is not None for r in rows) else 1


def _weights_list(text: str) -> list[str]:
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n != "bf16" and n not in WEIGHT_PRESETS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"weights formats are bf16 or {', '.join(WEIGHT_PRESETS)}, got {text!r}"
        )
    return names


def run_weights(args: argparse.Namespace, tuning: Any, ceilings: Any, device: str) -> int:
    from onestream.kernels.bench_quant import bench_weights, format_weights, weights_json
    from onestream.kernels.random_model import config_27b

    formats = args.weights if "bf16" in args.weights else ["bf16", *args.weights]
    name = f"27B shapes ({args.layers} of 64 layers)" if args.layers != 64 else "27B shapes"
    context = args.context[0]
    rows = bench_weights(config_27b(args.layers), formats, context=context, steps=args.steps, tuning=tuning)
    # Each --variant times the quantized formats again with its Tuning (bf16 rows: the default build's).
    quantized = [f for f in formats if f != "bf16"]
    variants = {
        label: bench_weights(config_27b(args.layers), quantized, context=context, steps=args.steps, tuning=t)
        for label, t in args.variant
    }
    print(f"device: {device}")
    print(
        f"measured ceilings: copy {ceilings.copy_gbs:.0f} GB/s (read+write), read {ceilings.read_gbs:.0f} GB/s"
    )
    print(format_weights(ceilings, rows, f"{name}, context {context}"), flush=True)
    bf16 = [r for r in rows if r.weights == "bf16"]
    for label, vrows in variants.items():
        print(
            format_weights(ceilings, bf16 + vrows, f"{name}, context {context}, variant {label}"), flush=True
        )
    if args.json:
        record = {
            "device": device,
            "layers": args.layers,
            "context": context,
            **weights_json(ceilings, rows),
            "variants": {label: weights_json(ceilings, bf16 + v) for label, v in variants.items()},
        }
        Path(args.json).write_text(json.dumps(record, indent=2))
    everything = rows + [r for v in variants.values() for r in v]
    return 0 if all(r.tok_s is not None for r in everything) else 1


def run_decode(args: argparse.Namespace) -> int:
    import torch

    labels = [label for label, _ in args.variant]
    if len(set(labels)) != len(labels):
        print(f"onestream bench decode: --variant labels repeat: {labels}", file=sys.stderr)
        return 2
    if args.kv_cache != ["auto"] and len(args.context) < 2:
        print("onestream bench decode: --kv-cache needs several --context lengths", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("onestream bench decode: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    from onestream.kernels.benchmark import as_json, bench_model, format_results, measure_ceilings
    from onestream.kernels.random_model import config_27b
    from onestream.kernels.tuning import tuning_from_env

    try:
        default = tuning_from_env()  # the build a card would run here ($ONESTREAM_MK_*)
    except ValueError as e:
        print(f"onestream bench decode: {e}", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings.copy_gbs:.0f} GB/s, read {ceilings.read_gbs:.0f} GB/s", flush=True)
    if len(args.context) > 1:
        return run_contexts(args, default, ceilings, device)
    if args.weights:
        return run_weights(args, default, ceilings, device)
    args.context = args.context[0]
    results = []
    alternated: list = []
    if not args.skip_27b:
        tunings = {"default": default}
        if args.sweep:
            tunings["tensor-core GEMV"] = dataclasses.replace(default, mma=True)
            tunings["phase timing"] = dataclasses.replace(default, phase_timing=True)
        tunings.update(dict(args.variant))
        name = f"27B shapes ({args.layers} of 64 layers)" if args.layers != 64 else "27B shapes"
        results.append(
            bench_model(
                name,
                config_27b(args.layers),
                context=args.context,
                steps=args.steps,
                ref_steps=args.ref_steps,
                hf=not args.skip_hf,
                tunings=tunings,
            )
        )
        print(format_results(ceilings, results[-1:], device), flush=True)
        if args.alternate > 0:
            alternated = run_alternated(args, tunings, ceilings, results[-1].bytes_per_token)
        torch.cuda.empty_cache()
    from onestream.worker.loading import default_model_dir, load_model

    small_dir = Path(args.small_model) if args.small_model else default_model_dir()
    if (small_dir / "config.json").is_file() and any(small_dir.glob("*.safetensors")):
        small_model = load_model(small_dir, dtype=torch.bfloat16, device="cuda")
        small_config = small_model.config
        small_name = "embedded model" if not args.small_model else f"model {small_dir.name}"
    else:
        from onestream.worker.testing import tiny_config

        small_model, small_config, small_name = None, tiny_config(), "tiny test model (random weights)"
    results.append(
        bench_model(
            small_name,
            small_config,
            context=args.context,
            steps=args.steps * 4,
            ref_steps=args.ref_steps * 2,
            hf=not args.skip_hf,
            model=small_model,
            tunings={"default": default},
        )
    )
    print()
    print(format_results(ceilings, results, device))
    if args.json:
        record = {"device": device, **as_json(ceilings, results)}
        if alternated:
            record["alternated"] = [dataclasses.asdict(r) for r in alternated]
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


def run_alternated(args: argparse.Namespace, tunings: dict, ceilings: Any, bytes_per_token: int) -> list:
    """`--alternate`: the builds that time the plain kernel (not the phase-timing ones), rounds alternating."""
    from onestream.kernels.alternate import format_alternated
    from onestream.kernels.benchmark import alternated_builds
    from onestream.kernels.random_model import config_27b, random_model

    builds = {label: t for label, t in tunings.items() if not t.phase_timing}
    model = random_model(config_27b(args.layers), seed=7)
    alternated = alternated_builds(
        model, builds, context=args.context, steps=args.steps, rounds=args.alternate
    )
    floor_ms = 1e3 * bytes_per_token / (ceilings.read_gbs * 1e9)
    print(
        f"\n== alternated builds, 27B shapes ({args.layers} layers), {args.alternate} rounds of {args.steps} steps"
    )
    print(format_alternated(alternated, floor_ms=floor_ms), flush=True)
    del model
    return alternated


SPEC_DOC = """`onestream bench spec`: the cost of speculative decoding on the megakernel, in one run. (a) One launch of
T = 1..8 tokens on the 27B shapes (random bf16 weights), plain and as a verify pass, relative to one T = 1 step
(target: at most 1.15x at T = 4). (b) One MTP draft step relative to one main-model step, same shapes.
(c) Greedy tok/s and mean accepted length on held-out code with the embedded model for k = 1..4, megakernel
against plain megakernel decode and against the reference back end, and whether greedy speculative output
equals plain greedy output. `--cycle` replaces (a) and (b) with (d): one whole speculative cycle for k = 1..6
through the engine, every number of accepted drafts a = 0..k forced by a benchmark-only back end, against the same
launches on the device alone and against one plain step; plain decode through the engine against the kernel's
chained rate; tok/s projected at stated per-position acceptance profiles (--profile), and at the embedded model's
measured one when (c) runs. Needs a CUDA GPU and CuPy."""


def _tokens_per_launch(text: str) -> int:
    from onestream.kernels.layout import MAX_TOKENS_PER_LAUNCH  # plain Python, no torch

    value = int(text)
    if not 1 <= value <= MAX_TOKENS_PER_LAUNCH:
        raise argparse.ArgumentTypeError(f"tokens per launch must be 1..{MAX_TOKENS_PER_LAUNCH}, got {value}")
    return value


def _drafts_per_cycle(text: str) -> int:
    from onestream.kernels.layout import MAX_TOKENS_PER_LAUNCH

    value = int(text)
    # k drafts and the pending token make one verify launch
    if not 1 <= value <= MAX_TOKENS_PER_LAUNCH - 1:
        raise argparse.ArgumentTypeError(f"k must be 1..{MAX_TOKENS_PER_LAUNCH - 1}, got {value}")
    return value


def tuning_changes(text: str) -> dict[str, Any]:
    """The Tuning fields named in "key=value,key=value" (ints; booleans as 0/1/true/false), checked by building a
    Tuning from the defaults with them."""
    from onestream.kernels.tuning import Tuning

    types = {f.name: f.type for f in dataclasses.fields(Tuning)}
    changes: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip().lower()
        if not sep or key not in types:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(types))}"
            )
        if "bool" in str(types[key]):
            if value not in ("0", "1", "true", "false"):
                raise argparse.ArgumentTypeError(f"{key} takes 0/1/true/false, got {value!r}")
            changes[key] = value in ("1", "true")
        else:
            try:
                changes[key] = int(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{key} takes an integer, got {value!r}") from None
    try:
        Tuning(**changes)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return changes


# Builds `bench decode` names itself; a --variant may not take their labels.
_OWN_BUILDS = ("default", "tensor-core GEMV", "phase timing")


def _variant(text: str) -> tuple[str, Any]:
    from onestream.kernels.tuning import Tuning

    label, sep, fields = text.partition(":")
    label = label.strip()
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL:KEY=VALUE,...")
    if label in _OWN_BUILDS:
        raise argparse.ArgumentTypeError(f"{label!r} names one of the bench's own builds; pick another label")
    return label, Tuning(**tuning_changes(fields))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _profile(text: str) -> tuple[str, list[float]]:
    label, sep, values = text.rpartition(":")
    try:
        probs = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL:P1,P2,... with numbers") from None
    if not probs or any(not 0 <= p <= 1 for p in probs) or any(b > a for a, b in itertools.pairwise(probs)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: acceptance per position must be in [0, 1], non-increasing"
        )
    return (label if sep and label else "profile " + values), probs


def _add_spec(sub: argparse._SubParsersAction) -> None:
    spec = sub.add_parser(
        "spec", help="verify/draft launch cost and speculative tok/s on the megakernel", description=SPEC_DOC
    )
    spec.add_argument(
        "--layers", type=_positive, default=64, help="layers of the 27B-shaped model (64 = the real depth)"
    )
    spec.add_argument("--context", type=_positive, default=64, help="tokens in the state before timing")
    spec.add_argument(
        "--tokens",
        type=_tokens_per_launch,
        nargs="+",
        default=list(range(1, 9)),
        help="tokens per launch to time (T = 1 is always timed: the ratios are to it)",
    )
    spec.add_argument("--launches", type=_positive, default=16, help="back-to-back launches per timed chain")
    spec.add_argument("--repeats", type=_positive, default=3, help="timed chains per figure (median)")
    spec.add_argument(
        "--model", default=None, help="checkpoint dir for part (c) (default: the embedded model)"
    )
    spec.add_argument(
        "--prompts",
        type=Path,
        nargs="+",
        default=None,
        help="files or folders to cut held-out prompts from (default: the exported held-out files in "
        ".data/default_model/spec_prompts)",
    )
    spec.add_argument(
        "--k", type=_drafts_per_cycle, nargs="+", default=[1, 2, 3, 4], help="drafts per cycle to try"
    )
    spec.add_argument("--prompt-tokens", type=_positive, default=128, help="tokens per prompt")
    spec.add_argument("--prompts-per-file", type=_positive, default=1)
    spec.add_argument("--max-prompts", type=_positive, default=12)
    spec.add_argument("--max-tokens", type=_positive, default=64, help="greedy tokens generated per prompt")
    spec.add_argument(
        "--gemv",
        choices=["scalar", "mma"],
        default="scalar",
        help="the GEMV of parts (a) and (b): the scalar FMA path (the default build) or the tensor cores",
    )
    spec.add_argument(
        "--phase-timing",
        action="store_true",
        help="parts (a) and (b) with the per-phase timing build: prints where each T's launch spends its time",
    )
    spec.add_argument(
        "--tuning",
        type=tuning_changes,
        default=None,
        metavar="KEY=VALUE,...",
        help="parts (a) and (b) with these Tuning fields changed (applied after --gemv and --phase-timing)",
    )
    spec.add_argument(
        "--weights",
        choices=("bf16", *WEIGHT_PRESETS),
        default="bf16",
        help="the 27B-shaped model's GEMV weights in parts (a), (b) and (d): bf16, or random blocks typed by "
        "that quantization preset's rule (the verify and draft ratios at 4 bits: q4_k_m)",
    )
    spec.add_argument(
        "--cycle",
        action="store_true",
        help="part (d), whole cycles through the engine with forced acceptance, instead of (a) and (b)",
    )
    spec.add_argument(
        "--cycle-k",
        type=_drafts_per_cycle,
        nargs="+",
        default=None,
        help="drafts per cycle of part (d) (1..6)",
    )
    spec.add_argument(
        "--cycles", type=_positive, default=10, help="cycles timed per (k, accepted) in part (d)"
    )
    spec.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="greedy drafts among the first N token ids in parts (b) and (d) (default: 32768 for a vocabulary "
        "above 65536, else all; 0: the whole vocabulary)",
    )
    spec.add_argument(
        "--profile",
        type=_profile,
        action="append",
        default=None,
        metavar="LABEL:P1,P2,...",
        help="a per-position acceptance profile (P(draft j accepted), non-increasing) to project part (d)'s "
        "tok/s at (repeatable; default: the published 0.96,0.80,0.64 at k = 3)",
    )
    spec.add_argument("--skip-27b", action="store_true", help="leave out parts (a) and (b) (and (d))")
    spec.add_argument("--skip-embedded", action="store_true", help="leave out part (c)")
    spec.add_argument("--json", default=None, help="write the results to this JSON file (after every part)")
    spec.set_defaults(func=run_spec)


def run_spec(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("onestream bench spec: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    from onestream.kernels import bench_spec as bs
    from onestream.kernels.benchmark import measure_ceilings
    from onestream.kernels.random_model import config_27b
    from onestream.worker.loading import default_model_dir

    files: list[Path] = []
    if not args.skip_embedded:
        try:
            files = bs.prompt_files(args.prompts or [bs.DEFAULT_PROMPTS_DIR])
        except FileNotFoundError as e:
            hint = "" if args.prompts else f" (export them with `{bs.EXPORT_HINT}`, or pass --prompts)"
            print(f"onestream bench spec: {e}{hint}", file=sys.stderr)
            return 2
        if not files:
            print("onestream bench spec: no prompt files found", file=sys.stderr)
            return 2

    result = bs.SpecBenchResult(torch.cuda.get_device_name(0))

    def save() -> None:  # after every part, so that a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(bs.as_json(result), indent=2))

    result.ceilings = measure_ceilings()
    print(bs.format_report(result), flush=True)
    if args.cycle and not args.skip_27b:
        from onestream.kernels import bench_cycle as bc
        from onestream.kernels.tuning import tuning_from_env

        try:
            tuning = tuning_from_env(mma=args.gemv == "mma")
        except ValueError as e:
            print(f"onestream bench spec: {e}", file=sys.stderr)
            return 2
        profiles = dict(args.profile or [("published (k = 3, code)", list(bc.PUBLISHED_PROFILE))])
        gemv = "tensor-core GEMV" if args.gemv == "mma" else "scalar GEMV"
        result.cycle = bc.bench_cycle(
            config_27b(args.layers),
            name=f"27B shapes ({args.layers} layers), {args.weights} weights, {gemv}",
            weights=args.weights,
            ks=args.cycle_k or list(bc.CYCLE_KS),
            context=args.context,
            cycles=args.cycles,
            repeats=args.repeats,
            tuning=tuning,
            profiles=profiles,
            draft_vocab=args.draft_vocab,
        )
        save()
        print("\n" + bc.format_cycle(result.cycle), flush=True)
    elif not args.skip_27b:
        tokens = sorted({1, *args.tokens})
        from onestream.kernels.tuning import tuning_from_env

        gemv = "tensor-core GEMV" if args.gemv == "mma" else "scalar GEMV"
        if args.phase_timing:
            gemv += ", phase-timing build"
        try:
            tuning = tuning_from_env(mma=args.gemv == "mma", phase_timing=args.phase_timing)
        except ValueError as e:
            print(f"onestream bench spec: {e}", file=sys.stderr)
            return 2
        if args.tuning:
            try:
                tuning = dataclasses.replace(tuning, **args.tuning)
            except ValueError as e:
                print(f"onestream bench spec: --tuning: {e}", file=sys.stderr)
                return 2
            gemv += ", " + ", ".join(f"{k}={v}" for k, v in args.tuning.items())
        result.verify, result.draft = bs.bench_27b(
            config_27b(args.layers),
            name=f"27B shapes (64 layers in the real model), {args.weights} weights, {gemv}",
            weights=args.weights,
            tuning=tuning,
            tokens=tokens,
            context=args.context,
            launches=args.launches,
            repeats=args.repeats,
            draft_vocab=args.draft_vocab,
        )
        save()
        print("\n" + bs.format_verify(result.verify, result.ceilings), flush=True)
        print("\n" + bs.format_draft(result.draft), flush=True)
    if not args.skip_embedded:
        result.embedded = bs.bench_embedded(
            Path(args.model) if args.model else default_model_dir(),
            files,
            ks=args.k,
            prompt_tokens=args.prompt_tokens,
            prompts_per_file=args.prompts_per_file,
            max_prompts=args.max_prompts,
            max_tokens=args.max_tokens,
        )
        if result.cycle is not None:  # project the 27B cycle costs at the embedded model's own acceptance
            runs = result.embedded.backend("megakernel")
            measured = (
                max((r for r in runs.runs if r.k > 0), key=lambda r: r.k, default=None) if runs else None
            )
            if measured is not None:
                profile = [round(p, 3) for p in measured.acceptance_per_position()]
                result.cycle.profiles[f"the embedded model's measured (k = {measured.k})"] = profile
        save()
    print("\n== summary\n" + bs.format_report(result))
    return 0

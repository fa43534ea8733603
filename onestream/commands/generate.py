"""`onestream generate`: one completion on a local engine (or, with --server, through the pool), streamed,
then its statistics."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

MODEL_HELP = (
    "a Hugging Face checkpoint directory, a .gguf file, a directory holding one GGUF, or the first shard "
    "NAME-00001-of-0000N.gguf of a split GGUF (default: the embedded model)"
)
QUANTIZE_HELP = (
    "a llama.cpp preset of per-tensor types: q4_k_m, q5_k_m, q6_k or q8_0 (worker/quant/presets.py)"
)


def add_format_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """--quantize and --tokenizer (with `prefix`: the same for a second model, e.g. --against-quantize)."""
    parser.add_argument(
        f"--{prefix}quantize",
        default=None,
        metavar="PRESET",
        help=f"quantize a bf16/fp16/fp32 checkpoint while it loads: {QUANTIZE_HELP}",
    )
    parser.add_argument(
        f"--{prefix}tokenizer",
        default=None,
        metavar="DIR",
        help="a Hugging Face tokenizer directory to use instead of the checkpoint's own",
    )


def engine_format_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"quantize": args.quantize, "tokenizer_dir": args.tokenizer}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the model comes from and how it runs (shared with `onestream eval`)."""
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    add_format_arguments(parser)
    parser.add_argument("--backend", default="auto", choices=("auto", "reference", "megakernel"))
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present)")
    parser.add_argument(
        "--dtype", default=None, help="fp32 | bf16 | fp16 (default: bf16 on GPU, fp32 on CPU)"
    )
    add_kv_cache_argument(parser)


# worker/kv_cache.py's KV_FORMATS, kept here so that `onestream --help` does not load torch (a test pins them equal).
KV_CACHE_CHOICES = ("auto", "int8")


def add_kv_cache_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache",
        default="auto",
        choices=KV_CACHE_CHOICES,
        help="KV cache format: auto (the model's dtype) or int8 with a scale per head vector (about half the "
        "memory and the bytes attention reads)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    from onestream.cluster.client import add_sampling_flags

    parser = subparsers.add_parser(
        "generate", help="complete a prompt and print its statistics", description=__doc__
    )
    parser.add_argument("prompt_words", nargs="*", metavar="PROMPT", help="the prompt (or use --prompt)")
    parser.add_argument("--prompt", default=None, help="the prompt text ('-' reads standard input)")
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as one user message (chat template)"
    )
    add_engine_arguments(parser)
    parser.add_argument(
        "--spec-k", type=int, default=None, help="MTP drafts per cycle (0 = off; default: engine's)"
    )
    add_drafting_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=128)
    temperature = "0 = greedy (default: the model's generation_config.json; greedy unless it sets do_sample)"
    add_sampling_flags(parser, help_overrides={"temperature": temperature})
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    parser.add_argument(
        "--no-token-healing",
        dest="token_healing",
        action="store_false",
        help="feed the prompt's tokens as they are (default: a prompt ending mid-token, like `def f():` "
        "where the model knows `):\\n`, has its last token re-chosen by the model)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    parser.add_argument("--server", default=None, help="generate through the pool's router at HOST:PORT")
    from onestream.cluster.client import add_api_key_argument

    add_api_key_argument(parser)
    parser.add_argument(
        "--session", default=None, help="session id (keeps the session's cache between turns)"
    )
    parser.set_defaults(func=run)


def add_drafting_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--drafting",
        choices=("combined", "mtp", "lookup"),
        default=None,
        help="speculative drafts: combined (copies from the context, or the MTP head when it is more "
        "confident; the default), mtp, or lookup (copies only; works without an MTP head)",
    )
    parser.add_argument(
        "--lookup-k", type=int, default=None, help="most drafts a copy from the context proposes per cycle"
    )


def drafting_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine keywords of `add_drafting_arguments`' flags that were given."""
    options = {"drafting": args.drafting, "lookup_k": args.lookup_k}
    return {name: value for name, value in options.items() if value is not None}


def _prompt_text(args: argparse.Namespace) -> str:
    if args.prompt == "-":
        return sys.stdin.read()
    if args.prompt is not None:
        return args.prompt
    if args.prompt_words:
        return " ".join(args.prompt_words)
    raise SystemExit("onestream generate: give a prompt (--prompt TEXT, a positional PROMPT, or --prompt -)")


def run(args: argparse.Namespace) -> int:
    args.prompt = _prompt_text(args)
    if args.server is not None:
        from onestream.cluster.client import run_generate

        return int(run_generate(args))

    from onestream.worker.api import SAMPLING_FIELDS, GenerateRequest
    from onestream.worker.engine import Engine, Finished
    from onestream.worker.errors import OnestreamError

    # Flags left out take the model's generation_config.json defaults (Engine.default_sampling).
    sampling: dict[str, Any] = {name: getattr(args, name) for name in SAMPLING_FIELDS}
    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        engine = Engine(
            args.model,
            backend=args.backend,
            device=args.device,
            dtype=args.dtype,
            spec_k=args.spec_k,
            **drafting_options(args),
            token_healing=args.token_healing,
            kv_cache=args.kv_cache,
            **engine_format_options(args),
        )
        request = GenerateRequest(
            prompt,
            engine.default_sampling(**sampling),
            max_tokens=args.max_tokens,
            stop=list(args.stop),
            session_id=args.session,
            ignore_eos=args.ignore_eos,
        )
        stream = engine.generate(request)
        text: list[str] = []
        token_ids: list[int] = []
        finished: Finished | None = None
        for item in stream:
            if isinstance(item, Finished):
                finished = item
                continue
            token_ids.extend(item.token_ids)
            text.append(item.text)
            if not args.json:
                sys.stdout.write(item.text)
                sys.stdout.flush()
    except (OnestreamError, ValueError) as e:
        print(f"onestream generate: {e}", file=sys.stderr)
        return 2
    assert finished is not None
    if args.json:
        record = {
            "text": "".join(text),
            "token_ids": token_ids,
            "finish_reason": finished.finish_reason,
            "stop_reason": finished.stop_reason,
            "usage": finished.usage.as_dict(),
            "timings": {k: v for k, v in finished.timings.as_dict().items() if k != "inter_token_s"},
            "model": engine.model_info(),
        }
        print(json.dumps(record, indent=2))
    else:
        print()
        print(describe(finished, engine.model_info()), file=sys.stderr)
    return 0


def describe(finished: Any, info: dict[str, Any]) -> str:
    """One line of statistics for a finished generation."""
    u, t = finished.usage, finished.timings
    decode_tokens = max(u.generated_tokens - 1, 0)
    parts = [
        f"finish={finished.finish_reason}",
        f"prompt={u.prompt_tokens} (cached {u.cached_prompt_tokens})",
        f"generated={u.generated_tokens}",
        f"ttft={t.time_to_first_token_s * 1e3:.1f}ms",
        f"prefill={t.prefill_s * 1e3:.1f}ms",
        f"decode={decode_tokens / t.decode_s if t.decode_s > 0 else 0.0:.1f} tok/s",
    ]
    if u.drafts:
        parts.append(
            f"spec {info['drafting']} k={info['spec_k']}: accepted {u.accepted_draft_tokens}/{u.draft_tokens} "
            f"drafts, mean accepted length {1 + u.accepted_draft_tokens / u.drafts:.2f}"
            + "".join(f", {s} {c.accepted_tokens}/{c.draft_tokens}" for s, c in sorted(u.by_source.items()))
        )
    parts.append(f"[{info['backend']} {info['device']} {info['dtype']}]")
    return "  ".join(parts)

"""`onestream quantize`: write a full-precision checkpoint as a quantized `qwen35` GGUF (MTP head included) that
the `gguf` package and llama.cpp read."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .generate import MODEL_HELP, QUANTIZE_HELP


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "quantize", help="write a checkpoint as a quantized GGUF file", description=__doc__
    )
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--type", required=True, metavar="PRESET", help=QUANTIZE_HELP)
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--device", default="cpu", help="where to quantize (cpu, cuda, ...)")
    p.add_argument(
        "--tokenizer", default=None, metavar="DIR", help="a Hugging Face tokenizer to write instead"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from onestream.worker.checkpoints import open_checkpoint
    from onestream.worker.checkpoints.gguf_writer import write_gguf
    from onestream.worker.errors import OnestreamError
    from onestream.worker.progress import LoadProgress

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    if out.suffix != ".gguf":
        print(f"onestream quantize: --out {out} must end in .gguf", file=sys.stderr)
        return 2
    try:
        source = open_checkpoint(args.model, tokenizer_dir=args.tokenizer)
        progress = LoadProgress(source.stored_sizes(), stage=f"quantizing to {args.type}")
        write_gguf(source, out, preset=args.type, device=args.device, progress=progress)
        written = open_checkpoint(out)  # read back: the file must load as it was meant
    except (OnestreamError, ValueError, OSError) as e:
        print(f"onestream quantize: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {written.format.describe()}")
    return 0

"""How much of a text a draft vocabulary holds: the share of its tokens among the first N ids of the model's
tokenizer, and the prefix the engine's DraftVocabulary would learn from it (worker/draft_vocab.py). Run it
with a real model's tokenizer on the traffic its cards serve to see what drafting among a prefix would cost.

    python tools/draft_vocab_coverage.py FILE... [--model DIR] [--prefix 1024 2048 4096]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.draft_vocab import COVERAGE, WARMUP, DraftVocabulary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--model", default=None, help="a checkpoint (default: the embedded model)")
    ap.add_argument("--prefix", type=int, nargs="+", default=[1024, 2048, 4096, 6144, 32768])
    args = ap.parse_args(argv)
    checkpoint = open_checkpoint(args.model)
    vocab = checkpoint.config.vocab_size
    ids = np.array(
        [t for f in args.files for t in checkpoint.tokenizer().encode(f.read_text(errors="replace"))]
    )
    print(f"{len(ids)} tokens of {len(args.files)} files, vocabulary {vocab}")
    for n in args.prefix:
        if n < vocab:
            print(f"  the first {n} ids hold {100 * float((ids < n).mean()):.1f} %")
    ranked = np.sort(ids)
    print(
        f"  {100 * COVERAGE:.1f} % of the tokens need ids below {int(ranked[int(len(ranked) * COVERAGE) - 1]) + 1}"
    )
    learnt = DraftVocabulary(vocab)
    learnt.observe(ids.tolist())
    chosen = learnt.rows if learnt.seen >= WARMUP else "none yet (fewer tokens than its warm-up)"
    print(f"  DraftVocabulary learns: {chosen if chosen is not None else 'the whole vocabulary'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

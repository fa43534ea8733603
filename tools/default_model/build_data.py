"""Builds everything training needs, on this machine: corpus list, tokenizer, token files.

    python -m tools.default_model.build_data [--vocab 8192] [--assets worker/assets/default_model] [--data .data/default_model]

Writes into the asset folder `corpus_files.tsv.gz` (split, path, bytes, sha256 per file), `corpus.json`
(the list's sha256, sources, versions, licences, counts), `tokenizer.json` and `tokenizer_config.json`;
into the data folder (git-ignored, carried to the GPU machine) `train.u16.xz` and `heldout.u16.xz`:
little-endian uint16 token ids, each file's tokens followed by <|endoftext|>, in path order.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
from pathlib import Path

import numpy as np

from . import corpus, tokenizer_train

END_OF_TEXT_ID = 0
DEFAULT_ASSETS = Path("worker/assets/default_model")
DEFAULT_DATA = Path(".data/default_model")


def encode_split(tok, texts: list[str]) -> np.ndarray:
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.array([END_OF_TEXT_ID], dtype=np.uint16))
    return np.concatenate(parts)


def write_tokens(path: Path, ids: np.ndarray) -> str:
    data = ids.astype("<u2").tobytes()
    path.write_bytes(lzma.compress(data, preset=6))
    return hashlib.sha256(data).hexdigest()


def read_tokens(path: Path) -> np.ndarray:
    return np.frombuffer(lzma.decompress(path.read_bytes()), dtype="<u2")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--assets", type=Path, default=DEFAULT_ASSETS)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args(argv)
    args.assets.mkdir(parents=True, exist_ok=True)
    args.data.mkdir(parents=True, exist_ok=True)

    files = corpus.collect()
    tsv = corpus.list_tsv(files)
    with (
        (args.assets / "corpus_files.tsv.gz").open("wb") as raw,
        gzip.GzipFile(filename="corpus_files.tsv", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz,
    ):
        gz.write(tsv.encode())
    texts = {
        split: [corpus.read_text(f) for f in files if f.split == split] for split in ("train", "heldout")
    }

    tok = tokenizer_train.train_tokenizer(texts["train"], args.vocab)
    tokenizer_train.save(tok, args.assets)

    token_info = {}
    for split, split_texts in texts.items():
        ids = encode_split(tok, split_texts)
        digest = write_tokens(args.data / f"{split}.u16.xz", ids)
        n_bytes = sum(len(t.encode()) for t in split_texts)
        token_info[split] = {"tokens": int(ids.size), "bytes": n_bytes, "tokens_sha256": digest}
        print(
            f"{split}: {len(split_texts)} files, {n_bytes / 1e6:.1f} MB, {ids.size / 1e6:.2f} M tokens",
            flush=True,
        )

    description = {
        "list_file": "corpus_files.tsv.gz",
        "list_sha256": corpus.list_hash(tsv),
        "list_sha256_of": "the uncompressed TSV (split, path, bytes, sha256 per line)",
        **corpus.sources_description(),
        "summary": corpus.summary(files),
        "tokens": token_info,
        "tokenizer_sha256": hashlib.sha256((args.assets / "tokenizer.json").read_bytes()).hexdigest(),
    }
    (args.assets / "corpus.json").write_text(json.dumps(description, indent=1) + "\n")
    (args.data / "meta.json").write_text(json.dumps(description, indent=1) + "\n")
    print(json.dumps({"list_sha256": description["list_sha256"], "tokens": token_info}, indent=1))


if __name__ == "__main__":
    main()

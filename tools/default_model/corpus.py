"""The embedded model's corpus: Python source already installed on this machine.

Sources are the interpreter's standard library and a fixed list of permissively licensed packages from the
project's virtual environment. Files are filtered (UTF-8, not generated-looking, not tiny or huge),
deduplicated by content and split into train / held-out at file level by a hash of the relative path, so
the split never depends on the order files are found in.

The file list (split, relative path, size, sha256) is written as a TSV; its sha256 identifies the corpus
and is recorded with the model.

    python -m tools.default_model.corpus --list worker/assets/default_model/corpus_files.tsv
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

HELDOUT_FRACTION = 0.03
MIN_BYTES = 200
MAX_BYTES = 400_000
MAX_LINE_CHARS = 400  # longer lines are data blobs (tables, base64), not code worth learning
MAX_MEAN_LINE_CHARS = 90

# (distribution, top-level folders in site-packages, licence as its metadata states it).
# Chosen for permissive licences and for being installed by tools/bootstrap.sh everywhere.
PACKAGES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("torch", ("torch", "torchgen", "functorch"), "BSD-3-Clause"),
    ("numpy", ("numpy",), "BSD-3-Clause"),
    ("sympy", ("sympy",), "BSD-3-Clause"),
    ("mpmath", ("mpmath",), "BSD-3-Clause"),
    ("networkx", ("networkx",), "BSD-3-Clause"),
    ("ray", ("ray",), "Apache-2.0"),
    ("transformers", ("transformers",), "Apache-2.0"),
    ("huggingface_hub", ("huggingface_hub",), "Apache-2.0"),
    ("setuptools", ("setuptools",), "MIT"),
    ("pip", ("pip",), "MIT"),
    ("pytest", ("_pytest",), "MIT"),
    ("jinja2", ("jinja2",), "BSD-3-Clause"),
    ("pygments", ("pygments",), "BSD-2-Clause"),
    ("requests", ("requests",), "Apache-2.0"),
    ("urllib3", ("urllib3",), "MIT"),
    ("rich", ("rich",), "MIT"),
    ("pydantic", ("pydantic",), "MIT"),
    ("click", ("click",), "BSD-3-Clause"),
    ("aiohttp", ("aiohttp",), "Apache-2.0 AND MIT"),
    ("attrs", ("attr", "attrs"), "MIT"),
    ("jsonschema", ("jsonschema",), "MIT"),
    ("fsspec", ("fsspec",), "BSD-3-Clause"),
    ("anyio", ("anyio",), "MIT"),
    ("grpcio", ("grpc",), "Apache-2.0"),
    ("protobuf", ("google/protobuf",), "BSD-3-Clause"),
    ("packaging", ("packaging",), "Apache-2.0 OR BSD-2-Clause"),
    ("markdown-it-py", ("markdown_it",), "MIT"),
    ("typer", ("typer",), "MIT"),
    ("virtualenv", ("virtualenv",), "MIT"),
    ("prometheus_client", ("prometheus_client",), "Apache-2.0 AND BSD-2-Clause"),
    ("PyYAML", ("yaml",), "MIT"),
)
# Standard-library folders that are not the library: third-party installs and build leftovers.
STDLIB_SKIP = ("site-packages", "dist-packages", "config-", "lib-dynload", "__pycache__")


@dataclass(frozen=True)
class CorpusFile:
    split: str  # "train" or "heldout"
    path: str  # relative, with a source prefix: "python3.11/json/decoder.py", "torch/nn/..."
    size: int  # bytes of the (newline-normalised) text
    sha256: str
    source: Path  # where it was read from on this machine (not recorded)


def split_of(relative_path: str) -> str:
    """Deterministic file-level split: the first 32 bits of sha256(path) against HELDOUT_FRACTION."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest()[:8], 16) / 2**32
    return "heldout" if bucket < HELDOUT_FRACTION else "train"


def read_clean(path: Path) -> str | None:
    """The file's text with newlines normalised, or None when it is not code we want."""
    raw = path.read_bytes()
    if not MIN_BYTES <= len(raw) <= MAX_BYTES or b"\0" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if max(len(line) for line in lines) > MAX_LINE_CHARS:
        return None
    if len(text) / len(lines) > MAX_MEAN_LINE_CHARS:
        return None
    return text


def candidate_files() -> Iterator[tuple[str, Path]]:
    """(relative path, absolute path) of every .py file in the chosen sources, sorted within a source."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prefix = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for f in sorted(stdlib.rglob("*.py")):
        rel = f.relative_to(stdlib).as_posix()
        if not any(part.startswith(STDLIB_SKIP) for part in rel.split("/")):
            yield f"{prefix}/{rel}", f
    purelib = Path(sysconfig.get_paths()["purelib"])
    for _dist, folders, _licence in PACKAGES:
        for folder in folders:
            for f in sorted((purelib / folder).rglob("*.py")):
                if "__pycache__" not in f.parts:
                    yield f.relative_to(purelib).as_posix(), f


def collect() -> list[CorpusFile]:
    """The corpus: filtered, deduplicated by content (first path in sorted order wins), sorted by path."""
    seen: set[str] = set()
    files = []
    for rel, path in sorted(candidate_files()):
        text = read_clean(path)
        if text is None:
            continue
        data = text.encode()
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        files.append(CorpusFile(split_of(rel), rel, len(data), digest, path))
    return files


def read_text(f: CorpusFile) -> str:
    text = read_clean(f.source)
    if text is None or hashlib.sha256(text.encode()).hexdigest() != f.sha256:
        raise RuntimeError(f"{f.source} changed while the corpus was being built")
    return text


def list_tsv(files: list[CorpusFile]) -> str:
    return "".join(f"{f.split}\t{f.path}\t{f.size}\t{f.sha256}\n" for f in files)


def list_hash(tsv: str | bytes) -> str:
    """The corpus identity: sha256 of the file-list TSV's bytes."""
    return hashlib.sha256(tsv.encode() if isinstance(tsv, str) else tsv).hexdigest()


def sources_description() -> dict:
    """Where the corpus came from: interpreter and package versions, licences and the filter rules."""
    packages = []
    for dist, folders, licence in PACKAGES:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = None
        packages.append(
            {"distribution": dist, "version": version, "folders": list(folders), "license": licence}
        )
    return {
        "python_stdlib": {"version": sys.version.split()[0], "license": "PSF-2.0"},
        "packages": packages,
        "filters": {
            "suffix": ".py",
            "bytes": [MIN_BYTES, MAX_BYTES],
            "utf8": True,
            "max_line_chars": MAX_LINE_CHARS,
            "max_mean_line_chars": MAX_MEAN_LINE_CHARS,
            "dedupe": "sha256 of newline-normalised text; first path in sorted order kept",
            "heldout": f"int(sha256(path)[:8], 16) / 2**32 < {HELDOUT_FRACTION}",
        },
    }


def summary(files: list[CorpusFile]) -> dict:
    out: dict = {}
    for split in ("train", "heldout"):
        chosen = [f for f in files if f.split == split]
        out[split] = {"files": len(chosen), "bytes": sum(f.size for f in chosen)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", type=Path, help="write the file-list TSV here")
    args = parser.parse_args(argv)
    files = collect()
    tsv = list_tsv(files)
    if args.list:
        args.list.write_text(tsv)
    print(json.dumps({"list_sha256": list_hash(tsv), **summary(files)}, indent=1))


if __name__ == "__main__":
    main()

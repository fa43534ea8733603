"""Agent-like prompts for measuring speculative decoding (`onestream eval spec --workload`).

- `complete`: a stretch of a source file; the model continues it (fresh code: what MTP drafts best).
- `edit`: a stretch of a file, a line saying it follows again with one identifier renamed, and the edited
  version's first lines; the model continues writing the file back, so the continuation is largely a copy
  of the prompt (what a coding agent does when it rewrites a file or quotes lines it replaces).
- `mixed`: the two alternating.

Sources are held-out files of the model's training corpus where its file list ships with it
(`corpus_files.tsv.gz`: the embedded model's) and this machine has them with the same content (checked by
sha256), or any text files given. Everything is deterministic: the same files give the same prompts.
"""

from __future__ import annotations

import gzip
import hashlib
import keyword
import re
import sys
import sysconfig
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKLOADS = ("complete", "edit", "mixed")
CORPUS_LIST = "corpus_files.tsv.gz"
HELDOUT = "heldout"
IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b")
RENAMED_SUFFIX = "_v2"  # what `edit` appends to the identifier it renames


@dataclass(frozen=True)
class SourceFile:
    name: str
    text: str


def heldout_files(model_dir: str | Path, *, min_bytes: int = 0) -> tuple[list[SourceFile], int]:
    """(the model's held-out corpus files found on this machine with their recorded content, how many the
    list names). Ordered by sha256 of the path, so that a prefix of the list is a deterministic sample.
    FileNotFoundError when the model ships no corpus list."""
    listing = Path(model_dir) / CORPUS_LIST
    if not listing.is_file():
        raise FileNotFoundError(f"{model_dir} has no {CORPUS_LIST} (its corpus' file list): give FILES")
    rows = [line.split("\t") for line in gzip.decompress(listing.read_bytes()).decode().splitlines()]
    heldout = [(path, int(size), digest) for split, path, size, digest in rows if split == HELDOUT]
    found = []
    for path, size, digest in heldout:
        if size < min_bytes:
            continue
        text = _read_recorded(path, digest)
        if text is not None:
            found.append(SourceFile(path, text))
    found.sort(key=lambda f: hashlib.sha256(f.name.encode()).hexdigest())
    return found, len(heldout)


def _read_recorded(relative: str, digest: str) -> str | None:
    """The file the corpus list names (`python3.X/...` in the standard library, else a package path on
    sys.path), newline-normalised as the corpus was, if its sha256 is the recorded one."""
    stdlib_prefix = f"python{sys.version_info.major}.{sys.version_info.minor}/"
    if relative.startswith("python"):
        if not relative.startswith(stdlib_prefix):
            return None
        candidates = [Path(sysconfig.get_paths()["stdlib"]) / relative[len(stdlib_prefix) :]]
    else:
        candidates = [Path(entry) / relative for entry in sys.path if entry]
    for candidate in candidates:
        try:
            raw = candidate.read_bytes()
        except OSError:
            continue
        text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
        if hashlib.sha256(text.encode()).hexdigest() == digest:
            return text
    return None


def renamed(snippet: str) -> tuple[str, str, str] | None:
    """(the snippet with its most frequent non-keyword identifier renamed, old name, new name); None when
    no identifier occurs twice (nothing an edit would rewrite in several places)."""
    counts = Counter(
        word
        for word in IDENTIFIER.findall(snippet)
        if not keyword.iskeyword(word) and word != "self" and not word.startswith("__")
    )
    if not counts:
        return None
    old, seen = max(counts.items(), key=lambda item: (item[1], item[0]))
    if seen < 2:
        return None
    new = old + RENAMED_SUFFIX
    return re.sub(rf"\b{re.escape(old)}\b", new, snippet), old, new


@dataclass
class WorkloadPrompt:
    kind: str  # "complete" or "edit"
    source: str
    ids: list[int]
    # What a faithful continuation writes: the rest of the file (complete) or of the edited snippet (edit).
    expected: list[int] = field(default_factory=list)


def build_prompts(
    workload: str,
    sources: Sequence[SourceFile],
    tokenizer: Any,
    *,
    prompt_tokens: int,
    max_tokens: int,
    per_source: int,
    max_prompts: int,
) -> list[WorkloadPrompt]:
    """Up to `max_prompts` prompts of `workload` (`mixed`: complete and edit by turns), `per_source` from
    each file at evenly spaced places. A `complete` prompt is `prompt_tokens` tokens followed in the file by
    at least `max_tokens` more; an `edit` prompt holds a snippet of `prompt_tokens` tokens, the edit line and
    the edited snippet's first lines, with at least `max_tokens` tokens of the edited snippet left to write."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    kinds = ["complete", "edit"] if workload == "mixed" else [workload]
    prompts: list[WorkloadPrompt] = []
    turn = 0
    for source in sources:
        tokens = tokenizer.encode(source.text)
        last_start = len(tokens) - prompt_tokens - max_tokens
        if last_start < 0:
            continue
        count = min(per_source, last_start + 1)
        for i in range(count):
            start = (last_start * i) // max(count - 1, 1) if count > 1 else 0
            kind = kinds[turn % len(kinds)]
            if kind == "complete":
                end = start + prompt_tokens
                parts: tuple[list[int], list[int]] | None = (
                    tokens[start:end],
                    tokens[end : end + max_tokens],
                )
            else:
                parts = _edit_prompt(
                    tokenizer, tokens[start : start + prompt_tokens + max_tokens], max_tokens
                )
            if parts is None:
                continue
            prompts.append(WorkloadPrompt(kind, source.name, *parts))
            turn += 1
            if len(prompts) >= max_prompts:
                return prompts
    return prompts


def _edit_prompt(tokenizer: Any, window: list[int], max_tokens: int) -> tuple[list[int], list[int]] | None:
    """(original snippet, the edit line, and the edited snippet up to its first renamed line (inclusive);
    the first `max_tokens` tokens of the rest of the edited snippet), provided that many remain."""
    # Whole lines: a snippet cut mid-line makes the copy start mid-token.
    text = tokenizer.decode(window)
    lines = text.split("\n")[1:-1]
    if len(lines) < 4:
        return None
    snippet = "\n".join(lines) + "\n"
    edit = renamed(snippet)
    if edit is None:
        return None
    edited, old, new = edit
    header = f"\n\n# ---- the code above again, with `{old}` renamed to `{new}` ----\n"
    first_change = edited.index(new)
    cut = edited.find("\n", first_change) + 1 or len(edited)
    prompt = tokenizer.encode(snippet + header + edited[:cut])
    rest = tokenizer.encode(edited[cut:])
    return (prompt, rest[:max_tokens]) if len(rest) >= max_tokens else None

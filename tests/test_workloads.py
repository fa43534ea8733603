"""worker/workloads.py: the held-out corpus files found by their recorded sha256, and the complete / edit /
mixed prompts `onestream eval spec --workload` measures."""

from __future__ import annotations

import gzip
import hashlib
import sys
import sysconfig
from pathlib import Path

import pytest
from onestream.worker.testing import byte_level_tokenizer
from onestream.worker.workloads import (
    CORPUS_LIST,
    RENAMED_SUFFIX,
    SourceFile,
    build_prompts,
    heldout_files,
    renamed,
)

CODE = '''
def parse(items, limit):
    """Parse the items up to a limit."""
    result = []
    for item in items:
        if len(result) >= limit:
            break
        result.append(item.strip())
    return result


def total(values):
    count = 0
    for value in values:
        count += value
    return count
'''


class Tokenizer:
    """The tiny models' byte-level tokenizer, with the engine tokenizer's encode / decode."""

    def __init__(self) -> None:
        self.inner = byte_level_tokenizer()

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)


def stdlib_entry(name: str) -> tuple[str, str]:
    """(the corpus list's path of a standard-library file, the sha256 of its newline-normalised text)."""
    path = Path(sysconfig.get_paths()["stdlib"]) / name
    text = path.read_bytes().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    prefix = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return f"{prefix}/{name}", hashlib.sha256(text.encode()).hexdigest()


def test_heldout_files_are_those_found_with_their_recorded_content(tmp_path: Path) -> None:
    good, digest = stdlib_entry("json/decoder.py")
    other, other_digest = stdlib_entry("json/encoder.py")
    rows = [
        ("heldout", good, 10_000, digest),
        ("heldout", other, 10_000, "0" * 64),  # changed since the corpus was built: left out
        ("heldout", "no_such_package/missing.py", 10_000, "1" * 64),
        ("train", other, 10_000, other_digest),  # trained on: never a held-out prompt
    ]
    listing = "".join("\t".join(map(str, row)) + "\n" for row in rows)
    (tmp_path / CORPUS_LIST).write_bytes(gzip.compress(listing.encode()))
    found, listed = heldout_files(tmp_path)
    assert listed == 3 and [f.name for f in found] == [good]
    assert hashlib.sha256(found[0].text.encode()).hexdigest() == digest
    with pytest.raises(FileNotFoundError, match=CORPUS_LIST):
        heldout_files(tmp_path / "elsewhere")


def test_renamed_rewrites_the_most_frequent_identifier_everywhere() -> None:
    edited, old, new = renamed(CODE) or ("", "", "")
    assert old == "result" and new == "result" + RENAMED_SUFFIX  # 4 times; `self`, keywords, dunders never
    assert edited == CODE.replace("result", new)
    assert renamed("x = alpha + beta\n") is None  # nothing occurs twice


def test_prompts_of_each_workload() -> None:
    tokenizer = Tokenizer()
    sources = [SourceFile("a.py", CODE * 3), SourceFile("b.py", CODE.replace("result", "found") * 3)]
    options = {"prompt_tokens": 60, "max_tokens": 24, "per_source": 2, "max_prompts": 8}
    complete = build_prompts("complete", sources, tokenizer, **options)
    assert [p.kind for p in complete] == ["complete"] * 4
    assert all(len(p.ids) == 60 and tokenizer.decode(p.ids) in CODE * 3 + CODE.replace("result", "found") * 3
               for p in complete)  # fmt: skip
    assert all(tokenizer.decode(p.ids + p.expected) in CODE * 3 + CODE.replace("result", "found") * 3
               and len(p.expected) == 24 for p in complete)  # fmt: skip
    edit = build_prompts("edit", sources, tokenizer, **options)
    assert edit and all(p.kind == "edit" for p in edit)
    texts = {source.name: source.text for source in sources}
    for prompt in edit:
        original, header, rest = tokenizer.decode(prompt.ids).partition("\n\n# ---- the code above again")
        assert header and original.strip() and original in texts[prompt.source]  # the snippet, unchanged
        edited_start = rest.split("----\n", 1)[1]
        assert RENAMED_SUFFIX in edited_start and edited_start.endswith("\n")  # up to its first edited line
        # What a faithful continuation writes: the edited snippet's next tokens.
        written = edited_start + tokenizer.decode(prompt.expected)
        assert len(prompt.expected) == 24 and written in texts[prompt.source].replace(
            *renamed(original)[1:]  # type: ignore[misc]
        )
    mixed = build_prompts("mixed", sources, tokenizer, **options)
    assert [p.kind for p in mixed][:2] == ["complete", "edit"]
    assert mixed == build_prompts("mixed", sources, tokenizer, **options)  # deterministic
    with pytest.raises(ValueError, match="workload"):
        build_prompts("refactor", sources, tokenizer, **options)

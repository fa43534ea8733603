"""tools/gpu/tree_hash.sh: the fingerprint the device logs print of the sources they ran."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu" / "tree_hash.sh"
FOLDERS = ("onestream", "worker", "kernels", "cluster", "protos", "tools", "tests", "deploy")


def tree_hash(repo: Path) -> str:
    return subprocess.run(
        ["bash", str(SCRIPT), str(repo)], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_a_copy_without_history_has_the_checkouts_fingerprint_and_an_edit_changes_it(tmp_path: Path) -> None:
    """The device's copy of the tree has no git history of its own: its fingerprint is the checkout's while the
    sources are the same, and another one once a source differs."""
    copy = tmp_path / "copy"
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    here = tree_hash(ROOT)
    assert re.fullmatch(r"[0-9a-f]{12}", here)
    assert tree_hash(copy) == here
    (copy / "kernels" / "megakernel.cu").write_text(
        (ROOT / "kernels" / "megakernel.cu").read_text() + "\n// edit\n"
    )
    assert tree_hash(copy) != here

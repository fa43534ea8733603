"""The distribution's layout: short folder names on disk, installed only under `onestream.`."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

FOLDERS = ("cluster", "worker", "kernels", "protos")
PROBE = (
    "import importlib.util, json, sys\n"
    "names = sys.argv[1:]\n"
    "print(json.dumps({n: [importlib.util.find_spec(n) is not None, "
    "importlib.util.find_spec('onestream.' + n) is not None] for n in names}))\n"
)


def test_folders_install_under_onestream_not_at_the_top_level(tmp_path: Path) -> None:
    # Outside the repository (whose root pytest puts on sys.path), as an installed user sees it. PyPI has
    # unrelated `cluster`, `worker` and `kernels` packages: ours must not take those names.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *FOLDERS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = json.loads(out)
    for folder in FOLDERS:
        top_level, under_onestream = found[folder]
        assert under_onestream, f"onestream.{folder} is not importable"
        assert not top_level, f"`{folder}` became a top-level import name"


def test_console_script_and_extras() -> None:
    dist = importlib.metadata.distribution("onestream")
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert scripts == {"onestream": "onestream.cli:main"}
    assert {"gpu", "dev"} <= set(dist.metadata.get_all("Provides-Extra") or [])


def test_the_engine_does_not_import_the_pool() -> None:
    # The worker is the engine alone; the pool (cluster/) builds on it, never the reverse.
    worker = Path(__file__).resolve().parents[1] / "worker"
    offenders = [
        f"{path.relative_to(worker.parent)}:{number}"
        for path in sorted(worker.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if line.lstrip().startswith(("from onestream.cluster", "import onestream.cluster"))
    ]
    assert not offenders, f"worker/ imports cluster/: {offenders}"

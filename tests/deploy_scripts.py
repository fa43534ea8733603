"""Test helper: load a script of deploy/ or tools/ (not packages) as a module (the tests directory is on pytest's
path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_module(path: Path) -> ModuleType:
    """The script at `path` as a module named onestream_script_<stem> (registered before it runs: dataclasses look
    their module up while the class is built)."""
    name = f"onestream_script_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

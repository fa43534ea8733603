"""Building the embedded default model: corpus, tokenizer, training, evaluation (scripts, run with -m)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _ensure_onestream_importable() -> None:
    """Make `onestream.worker` importable from a plain checkout (the GPU machine has no editable install).

    The package maps top-level folders under `onestream.` only when installed; without the install the
    `worker/` folder is registered under that name by hand.
    """
    try:
        import onestream.worker

        return
    except ModuleNotFoundError:
        pass
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import onestream

    folder = REPO_ROOT / "worker"
    spec = importlib.util.spec_from_file_location(
        "onestream.worker", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    onestream.worker = module  # type: ignore[attr-defined]


_ensure_onestream_importable()

"""The distribution's layout: short folder names on disk, installed only under `onestream.`."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

FOLDERS = ("cluster", "worker", "kernels", "protos")
# Per name: where a top-level `name` would import from (None: nowhere), and whether onestream.name imports.
PROBE = (
    "import importlib.util, json, sys\n"
    "def origin(n):\n"
    "    spec = importlib.util.find_spec(n)\n"
    "    return None if spec is None else str(spec.origin or list(spec.submodule_search_locations or []))\n"
    "names = sys.argv[1:]\n"
    "print(json.dumps({n: [origin(n), importlib.util.find_spec('onestream.' + n) is not None] for n in names}))\n"
)
REPO = Path(__file__).resolve().parents[1]


def test_folders_install_under_onestream_not_at_the_top_level(tmp_path: Path) -> None:
    # Outside the repository (whose root pytest puts on sys.path), as an installed user sees it. PyPI has
    # unrelated `cluster`, `worker` and `kernels` packages (transformers installs Hugging Face's `kernels`):
    # ours must not take those names.
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
        assert top_level is None or str(REPO / folder) not in top_level, (
            f"`{folder}` became a top-level import name"
        )


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


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of `folders` it imports, at the top or inside a function."""
    root = Path(__file__).resolve().parents[1]
    paths = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for folder in folders
        for p in (root / folder).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        found: set[str] = set()
        tree = ast.parse(path.read_text())
        type_only = {  # `if TYPE_CHECKING:` imports never run
            id(n) for block in ast.walk(tree) if _is_type_checking(block) for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join([*package[: len(package) - node.level + 1], node.module or ""]).rstrip(".")
            elif isinstance(node, ast.ImportFrom):
                base = (node.module or "").removeprefix("onestream.")
            elif isinstance(node, ast.Import):
                found |= {a.name.removeprefix("onestream.") for a in node.names}
                continue
            else:
                continue
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
        # A module's own packages are imported before it, whatever it imports from them.
        ancestors = {".".join(package[:i]) for i in range(1, len(package) + 1)}
        graph[module] = {name for name in found if name in paths and name != module and name not in ancestors}
    return graph


# Edges of cycles already on main, each left to the work that owns it; remove an entry with its cycle.
KNOWN_CYCLE_EDGES = {}


def test_the_engine_and_the_pool_have_no_import_cycles() -> None:
    # Even a lazy import cycle means two modules each need the other: one of them holds the wrong code.
    graph = _imports(("worker", "cluster"))
    for module, dependency in KNOWN_CYCLE_EDGES:
        graph[module].discard(dependency)
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for dependency in sorted(graph[module]):
            assert dependency not in path, f"import cycle: {' -> '.join([*path, dependency])}"
            if dependency not in done:
                visit(dependency, [*path, dependency])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])


def test_every_package_folder_is_in_the_distribution() -> None:
    # setuptools installs only the packages pyproject lists: a new sub-package left out works in an editable
    # checkout and is missing from a built wheel.
    import tomllib

    root = Path(__file__).resolve().parents[1]
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folder_of = {name: folder for name, folder in setup["package-dir"].items()}
    listed = set(setup["packages"])
    for name, folder in folder_of.items():
        for init in sorted((root / folder).rglob("__init__.py")):
            package = ".".join([name, *init.parent.relative_to(root / folder).parts])
            assert package in listed, f"{init.parent.relative_to(root)} is not in pyproject's packages"

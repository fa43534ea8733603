"""The `onestream` console script: a thin dispatcher; each sub-command lives in onestream/commands/."""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-command modules, each exposing `register(subparsers)`; imported lazily so that `onestream --help`
# does not pay for torch, ray and grpc at once.
COMMAND_MODULES = {
    "generate": "onestream.commands.generate",
    "eval": "onestream.commands.eval",
    "serve": "onestream.commands.serve",
    "chat": "onestream.commands.chat",
    "status": "onestream.commands.status",
    "bench": "onestream.commands.bench",
    "soak": "onestream.commands.soak",
    "quantize": "onestream.commands.quantize",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onestream", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in COMMAND_MODULES.items():
        if only is not None and name != only:
            sub.add_parser(name, help=f"(run `onestream {name} --help`)", add_help=False)
            continue
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Import only the chosen command's module when one is named.
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=first if first in COMMAND_MODULES else None)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`onestream soak`: the soak test with larger numbers, for longer runs (cluster/soak.py says what it does
and checks). Starts its own local multi-node Ray cluster of CPU cards; exits 1 when a check failed."""

from __future__ import annotations

import argparse
import logging
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "soak",
        help="a fault-injecting load run against a local multi-node pool of CPU cards",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from onestream.cluster.soak import SoakSettings

    defaults = SoakSettings()
    p.add_argument("--cards", type=int, default=4, help="CPU cards (one Ray node each)")
    p.add_argument(
        "--sessions", type=int, default=8, help="concurrent sessions (twice the cards is the CI run)"
    )
    p.add_argument("--turns", type=int, default=40, help="turns per session")
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    p.add_argument("--cancel-rate", type=float, default=defaults.cancel_rate)
    p.add_argument("--abort-rate", type=float, default=defaults.abort_rate)
    p.add_argument("--memory-bound-mb", type=float, default=defaults.memory_bound_mb)
    p.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random one)")
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from onestream.cluster.soak import SoakSettings, run_soak

    report = run_soak(
        SoakSettings(
            cards=args.cards,
            sessions=args.sessions,
            turns=args.turns,
            max_tokens=args.max_tokens,
            cancel_rate=args.cancel_rate,
            abort_rate=args.abort_rate,
            memory_bound_mb=args.memory_bound_mb,
            seed=args.seed,
            model_dir=args.model,
        )
    )
    print(report.summary())
    for problem in report.problems:
        print(f"  problem: {problem}")
    return 1 if report.problems else 0

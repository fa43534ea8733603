"""Gathers one training run's records into results.json (run by tools/gpu/train_default_model.sh).

    python -m tools.default_model.run_report --work WORK --out results.json

WORK holds train_results.json (training, held-out evaluation), and when their stages ran spec.json
(`onestream eval spec --json`: greedy MTP acceptance) and samples.json (greedy completions); a missing or
unreadable record is noted under "missing" with the tail of its stage's log, not fatal.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RECORDS = {"training": "train_results.json", "spec": "spec.json", "samples": "samples.json"}
LOGS = {"spec": "spec.log", "samples": "samples.log"}
LOG_TAIL_CHARS = 2000


def gather(work: Path) -> dict:
    report: dict = {"missing": {}}
    for key, name in RECORDS.items():
        path = work / name
        try:
            report[key] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log = work / LOGS.get(key, "")
            tail = log.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log.is_file() else ""
            report["missing"][key] = {"error": f"{name}: {e}", "log_tail": tail}
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    report = gather(args.work)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    training = report.get("training", {})
    heldout = training.get("heldout", {})
    print(
        f"results: {training.get('steps')} steps, {training.get('tokens_trained')} tokens, "
        f"mode {training.get('step_mode')}, held-out loss {heldout.get('loss')}, "
        f"missing {sorted(report['missing'])}"
    )


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Sets up everything onestream needs in ./.venv (idempotent): the CPU build of torch unless one is
# already there, the project in editable mode with its dev extras, and Prometheus for the deploy tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# torch==2.13.0 is the CPU build kept on local disk on our machines; anywhere else pip fetches it.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
# The deploy tests drive a real Prometheus server; Debian packages it (promtool included).
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
    || echo "bootstrap: could not install prometheus; the deploy tests will be skipped" >&2
fi

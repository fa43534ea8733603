#!/usr/bin/env bash
# Same-call A/B of two source trees on the GPU machine: this tree against the whole tree in DIR (its own kernels/,
# plan and bench code: a build's CUDA sources only compile with the defines of their own kernels/plan.py), each
# timed by its own `tools/gpu/check_kernels.sh spec` (no tests).
#   run: bash tools/gpu/ab_kernels.sh DIR "BENCH OPTIONS A" ["BENCH OPTIONS B" ...]
# For each option set, in turn: this tree, then DIR's (for the first set), DIR's then this tree's (for the next),
# and so on, alternating so that drift on the machine does not favour one side. Logs: $OUT/<tree|base>_<i>.log.
# Make DIR from a commit with: mkdir DIR && git archive REF | tar -x -C DIR
# (docs/benchmarks.md names the commits and option sets of each A/B it reports).
set -uo pipefail
cd "$(dirname "$0")/../.."
DIR=$(cd "$1" && pwd)
shift
O=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$O"
TREE=$PWD
run() {  # side, option set index, options
  local root=$TREE
  [ "$1" = base ] && root=$DIR
  (cd "$root" && TEST_TIMEOUT=1 BENCH_TIMEOUT=${BENCH_TIMEOUT:-100} SPEC_RUNS="$3" OUT="$O/$1_$2" \
    bash tools/gpu/check_kernels.sh spec) >"$O/$1_$2.log" 2>&1
}
i=0
for opts in "$@"; do
  if [ $((i % 2)) -eq 0 ]; then order="tree base"; else order="base tree"; fi
  for side in $order; do run "$side" "$i" "$opts"; done
  i=$((i + 1))
done
for f in "$O"/*_[0-9]*.log; do echo "== $(basename "$f" .log)"; grep -E "ceilings|T=[0-9]: plain" "$f" | sort -u; done

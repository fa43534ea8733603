#!/usr/bin/env bash
# Same-call A/B of two kernel source trees on the GPU machine: the working tree's kernels/*.cu and *.cuh against
# those in DIR (copied over them for the B runs, put back after), each timed by `check_kernels.sh spec` (no tests).
#   run: bash tools/gpu/ab_kernels.sh DIR "BENCH OPTIONS A" ["BENCH OPTIONS B" ...]
# For each option set, in turn: A with this tree, then with DIR's (for the first set), DIR's then this tree's (for
# the next), and so on, alternating so that drift on the machine does not favour one side. Logs: $OUT/<tree>_<i>.log.
# Make DIR from a commit with: mkdir DIR && git archive REF kernels | tar -x -C DIR --strip-components=1
# (run 16 call 3: DIR from 76e2ad6, the options "--skip-embedded --gemv mma --tokens 1 4" and
# "--skip-embedded --tokens 1 4").
set -uo pipefail
cd "$(dirname "$0")/../.."
DIR=$1
shift
O=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$O"
MINE=$(mktemp -d)
cp kernels/*.cu kernels/*.cuh "$MINE/"
run() {  # tree name, option set index, options
  TEST_TIMEOUT=1 BENCH_TIMEOUT=${BENCH_TIMEOUT:-100} SPEC_RUNS="$3" OUT="$O/$1_$2" \
    bash tools/gpu/check_kernels.sh spec >"$O/$1_$2.log" 2>&1
}
use() { if [ "$1" = base ]; then cp "$DIR"/*.cu "$DIR"/*.cuh kernels/; else cp "$MINE"/* kernels/; fi; }
i=0
for opts in "$@"; do
  if [ $((i % 2)) -eq 0 ]; then order="tree base"; else order="base tree"; fi
  for side in $order; do use "$side"; run "$side" "$i" "$opts"; done
  i=$((i + 1))
done
use tree
for f in "$O"/*_[0-9]*.log; do echo "== $(basename "$f" .log)"; grep -E "ceilings|T=[0-9]: plain" "$f" | sort -u; done

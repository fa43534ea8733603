#!/usr/bin/env bash
# The fast prefill on the GPU machine, in one call: its GPU tests, the benchmark, then the megakernel
# continuing from its state (last: that test compiles a megakernel build).
#   run: bash tools/gpu/check_prefill.sh        (carry .whl holding fla_core-*.whl and einops-*.whl to test and
#   time flash-linear-attention's kernels; without them the torch delta rule runs alone)
# Logs and prefill.json go to $OUT. Stage limits (TEST_TIMEOUT 150, BENCH_TIMEOUT 115, MK_TIMEOUT 60 s) fit a
# 360 s device call (a cold machine compiles and tunes fla's Triton kernels for about a minute in the tests);
# BENCH_ARGS replaces the benchmark's options.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}
REPO=$PWD

. tools/gpu/env.sh  # the package layout and carried wheels (gguf, fla-core, einops); leaves us in the link tree

{
  echo "== $(date -u +%FT%TZ) sources $(bash "$REPO/tools/gpu/tree_hash.sh" "$REPO")"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import fla; from fla.ops.gated_delta_rule import chunk_gated_delta_rule; print('fla', fla.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$OUT/env.log"

PYTEST=(python3 -m pytest -q -s -rA -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml")
echo "== GPU tests" | tee -a "$OUT/env.log"
timeout "${TEST_TIMEOUT:-150}" "${PYTEST[@]}" -k "not megakernel" "$REPO/tests/test_prefill_gpu.py" 2>&1 | tee "$OUT/tests.log"
echo "tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/env.log"

echo "== prefill bench" | tee -a "$OUT/env.log"
timeout "${BENCH_TIMEOUT:-115}" python3 "$REPO/tools/gpu/prefill_bench.py" ${BENCH_ARGS:---budget-s 90} \
  --json "$OUT/prefill.json" 2>&1 | tee "$OUT/bench.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/env.log"

echo "== megakernel after the fast prefill" | tee -a "$OUT/env.log"
timeout "${MK_TIMEOUT:-60}" "${PYTEST[@]}" -k megakernel "$REPO/tests/test_prefill_gpu.py" 2>&1 | tee "$OUT/tests_mk.log"
echo "megakernel test exit: ${PIPESTATUS[0]}" | tee -a "$OUT/env.log"

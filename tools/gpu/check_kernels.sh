#!/usr/bin/env bash
# Build, test and time the decode megakernel on the GPU machine, in one call:
#   run: bash tools/gpu/check_kernels.sh [quick|full|spec|tests]   (spec: tests, then `onestream bench spec`;
#   tests: the GPU tests alone)
# Logs go to $OUT (the device tool brings them back), or to /tmp/onestream-gpu-logs elsewhere. Each stage has its own time
# limit and runs in its own process, so a failing stage still leaves the others' results.
# The stage limits (140 + 2 x 38 + 130 s, overridable: TEST_TIMEOUT, KLD_TIMEOUT, BENCH_TIMEOUT) fit a 400 s device
# call. The KLD check runs once per activation precision (default fp32 activations, then bf16)
# before the bench.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$OUT"
MODE=${1:-full}
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}

. tools/gpu/env.sh  # the package layout and carried wheels (gguf); leaves us in the link tree

{
  echo "== $(date -u +%FT%TZ) sources $(bash "$REPO/tools/gpu/tree_hash.sh" "$REPO")"
  python3 -c "import onestream.kernels, onestream.worker; print('package from', onestream.kernels.__file__)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.log"

echo "== GPU tests" | tee -a "$OUT/env.log"
TEST_FILES=(${TESTS:-test_kernels_gpu.py test_kernels_spec_gpu.py})
timeout "${TEST_TIMEOUT:-140}" python3 -m pytest -q -s -rA -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" \
  ${PYTEST_K:+-k "$PYTEST_K"} "${TEST_FILES[@]/#/$REPO/tests/}" 2>&1 | tee "$OUT/tests.log"
echo "tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/env.log"
[ "$MODE" = tests ] && exit 0

# Issue 6's correctness bar: the megakernel against the fp32 reference, teacher-forced over held-out tokens of
# the embedded model (a file of whitespace-separated ids; tools/gpu/README.md says how it is made). Once per
# precision: the default build (fp32 activations), then bf16 (the bf16 reference's numerics).
TOKENS=${KLD_TOKENS:-$REPO/.data/eval/heldout_tokens.txt}
if [ "$MODE" = full ] && [ -f "$TOKENS" ]; then
  for FP32_ACT in 1 0; do  # ONESTREAM_MK_FP32_ACT
    echo "== eval kld megakernel vs reference, ONESTREAM_MK_FP32_ACT=$FP32_ACT" | tee -a "$OUT/env.log"
    ONESTREAM_MK_FP32_ACT=$FP32_ACT timeout "${KLD_TIMEOUT:-38}" python3 -m onestream eval kld \
      --backend megakernel --against reference --tokens "$TOKENS" --ctx 512 2>&1 | tee "$OUT/kld_act${FP32_ACT}.log"
    echo "kld (fp32 activations $FP32_ACT) exit: ${PIPESTATUS[0]}" | tee -a "$OUT/env.log"
  done
fi

if [ "$MODE" = spec ] && [ -n "${SPEC_KLD:-}" ] && [ -f "$TOKENS" ]; then  # the KLD bar of the default build
  echo "== eval kld megakernel vs reference (default build)" | tee -a "$OUT/env.log"
  timeout "${KLD_TIMEOUT:-45}" python3 -m onestream eval kld --backend megakernel --against reference \
    --tokens "$TOKENS" --ctx 512 2>&1 | tee "$OUT/kld_default.log"
fi
if [ "$MODE" = spec ]; then  # issue 7: speculative decoding on the kernel (carry .data/default_model/spec_prompts)
  # SPEC_RUNS: several `bench spec` runs in one call, their options separated by "|" (e.g. the tensor-core GEMV
  # against "--gemv scalar --skip-embedded"); each gets BENCH_TIMEOUT and writes bench_spec_<i>.json.
  # SPEC_RUNS=none: no bench run (e.g. only the KLD check); unset or empty: one run with SPEC_ARGS.
  IFS='|' read -r -a RUNS <<<"${SPEC_RUNS:-${SPEC_ARGS:-}}"
  [ ${#RUNS[@]} -eq 0 ] && RUNS=("")
  [ "${SPEC_RUNS:-}" = none ] && RUNS=()
  for i in "${!RUNS[@]}"; do
    echo "== bench spec ${RUNS[$i]}" | tee -a "$OUT/env.log"
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-200}" python3 -m onestream bench spec --prompts "$REPO/.data/default_model/spec_prompts" \
      --json "$OUT/bench_spec_$i.json" ${RUNS[$i]} 2>&1 | tee "$OUT/bench_spec_$i.log"
    echo "bench spec ${RUNS[$i]} exit: ${PIPESTATUS[0]}" | tee -a "$OUT/env.log"
  done
  exit 0
fi

if [ "$MODE" = quick ]; then
  BENCH_ARGS=(--layers 16 --steps 32 --ref-steps 8 --skip-hf)
else
  BENCH_ARGS=(--layers 64 --steps 64 --ref-steps 12 --sweep --small-model "$REPO/worker/assets/default_model")
fi
# DECODE_ARGS: replaces the mode's options; BENCH_EXTRA: more options, e.g. "--alternate 6" (issue 6: builds timed
# against each other, rounds alternating)
if [ -n "${DECODE_ARGS:-}" ]; then
  # shellcheck disable=SC2206
  BENCH_ARGS=(${DECODE_ARGS})
fi
# shellcheck disable=SC2206
BENCH_ARGS+=(${BENCH_EXTRA:-})
echo "== bench decode ${BENCH_ARGS[*]}" | tee -a "$OUT/env.log"
timeout "${BENCH_TIMEOUT:-130}" python3 -m onestream bench decode "${BENCH_ARGS[@]}" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/env.log"

#!/usr/bin/env bash
# Several stages in one device call, each in its own process under its own time limit, all logged to one file
# ($OUT/batch.log: the device returns at most 8 files):
#   run (carry .whl): bash tools/gpu/batch.sh "LIMIT_S COMMAND..." ["LIMIT_S COMMAND..."] ...
# e.g. "150 python3 -m onestream bench spec --skip-embedded --weights q4_k_m --tokens 1 4". Commands run in env.sh's
# link tree ($REPO is the checkout, $OUT the returned folder); a stage that fails or times out leaves the others.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}
. tools/gpu/env.sh
export REPO
LOG=$OUT/batch.log
{
  echo "== $(date -u +%FT%TZ) sources $(bash "$REPO/tools/gpu/tree_hash.sh" "$REPO")"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
} 2>&1 | tee "$LOG"
for stage in "$@"; do
  limit=${stage%% *}
  cmd=${stage#* }
  echo "== $(date -u +%T) [${limit}s] $cmd" | tee -a "$LOG"
  start=$SECONDS
  timeout -k 5 "$limit" bash -c "$cmd" 2>&1 | grep --line-buffered -v "WARNING" | tee -a "$LOG"
  echo "== exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$LOG"
done

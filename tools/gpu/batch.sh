#!/usr/bin/env bash
# Several stages in one device call, each in its own process under its own time limit, all logged to one file
# ($OUT/batch.log: the device returns at most 8 files):
#   run (carry .whl): bash tools/gpu/batch.sh "LIMIT_S COMMAND..." ["LIMIT_S COMMAND..."] ...
# e.g. "150 python3 -m onestream bench spec --skip-embedded --weights q4_k_m --tokens 1 4". Commands run in env.sh's
# link tree ($REPO is the checkout, $OUT the returned folder); a stage that fails or times out leaves the others.
# CuPy's compiled kernels come back as $OUT/cupy_cache.tgz; saved as .cupy_cache.tgz in the checkout and carried,
# they spare the next call (a fresh machine, another session) the compilation of every build it already holds:
# CuPy keys each by its source, options, NVRTC version and architecture, so a changed kernel still compiles.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}
. tools/gpu/env.sh
export REPO
LOG=$OUT/batch.log
CACHE_BACK=$OUT/cupy_cache.tgz
CACHE_MAX_BYTES=$((15 << 20))  # the device returns files of at most 16 MiB
{
  echo "== $(date -u +%FT%TZ) sources $(bash "$REPO/tools/gpu/tree_hash.sh" "$REPO")"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  mkdir -p "$CUPY_CACHE_DIR"
  if [ -f "$REPO/.cupy_cache.tgz" ] && tar xzf "$REPO/.cupy_cache.tgz" -C "$CUPY_CACHE_DIR"; then
    echo "== carried kernel cache: $(find "$CUPY_CACHE_DIR" -type f | wc -l) files"
  fi
} 2>&1 | tee "$LOG"
for stage in "$@"; do
  limit=${stage%% *}
  cmd=${stage#* }
  echo "== $(date -u +%T) [${limit}s] $cmd" | tee -a "$LOG"
  start=$SECONDS
  timeout -k 5 "$limit" bash -c "$cmd" 2>&1 | grep --line-buffered -v "WARNING" | tee -a "$LOG"
  echo "== exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$LOG"
done
if [ -n "$(find "$CUPY_CACHE_DIR" -type f -print -quit)" ]; then
  tar czf "$CACHE_BACK" -C "$CUPY_CACHE_DIR" .
  if [ "$(stat -c %s "$CACHE_BACK")" -gt "$CACHE_MAX_BYTES" ]; then
    rm -f "$CACHE_BACK"
    echo "== kernel cache over $CACHE_MAX_BYTES bytes packed: not returned" | tee -a "$LOG"
  fi
fi

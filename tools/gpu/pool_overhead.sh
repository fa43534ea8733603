#!/usr/bin/env bash
# What the pool path costs against the engine in process (issue 23, "The engine"), in one device call:
# tools/gpu/pool_overhead.py on a random model of the 27B shapes, the engine in process, then a Ray card on the
# GPU behind the router and gRPC; prints the table, writes $OUT/pool_overhead.json.
#   run (carry .devpkgs .whl): [LIMIT=280] bash tools/gpu/pool_overhead.sh [pool_overhead.py options]   (default --layers 64)
# .devpkgs is check_pool.sh's (the Ray bundle and the gRPC health/reflection 1.84.0 wheels, see its header);
# .whl holds gguf (worker/quant, which the kernel plan imports): `pip download --no-deps -d .whl gguf`.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}  # one cache: the card reuses the builds
REPO=$PWD

. tools/gpu/ray_env.sh  # Ray from .devpkgs, then env.sh; leaves us in the link tree

echo "== $(date -u +%FT%TZ) sources $(bash "$REPO/tools/gpu/tree_hash.sh" "$REPO")" | tee "$OUT/pool_overhead.log"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a "$OUT/pool_overhead.log"
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--layers 64)
# --limit-s: on expiry the tool ends its side's process group and reports what it has (the engine's side first).
python3 "$REPO/tools/gpu/pool_overhead.py" "${ARGS[@]}" --out "$OUT" --limit-s "${LIMIT:-280}" 2>&1 |
  grep --line-buffered -v -e "WARNING" -e "has constructor arguments in the object store" \
    -e "Overwriting previous Ray address" | tee -a "$OUT/pool_overhead.log"
echo "exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pool_overhead.log"

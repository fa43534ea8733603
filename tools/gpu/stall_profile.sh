#!/usr/bin/env bash
# Where a decode launch's warps wait, per SASS instruction: Nsight Compute's warp-state sampling of one launch of
# profile_step.py (its second, so that the first launch's cold caches stay out), exported as the source page's CSV
# (one row per instruction with its stall samples by reason) and the details page. Read the CSV here with
# `python tools/stall_summary.py $FILES/stalls.csv.gz`.
#   run (GPU machine, carry .whl): bash tools/gpu/stall_profile.sh LAYERS scalar|mma T [--weights PRESET]
# Writes $OUT/stalls.csv.gz, $OUT/stalls_details.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}
. tools/gpu/env.sh
layers=$1 gemv=$2 t=$3
shift 3
rep=/tmp/stalls
ncu --clock-control none --kernel-name mk_decode --launch-skip 1 --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section SchedulerStats --section Occupancy \
  --section LaunchStats --section MemoryWorkloadAnalysis --import-source no -f -o "$rep" \
  python3 "$REPO/tools/gpu/profile_step.py" "$layers" "$gemv" "$t" "$t" "$@" || exit
ncu -i "$rep.ncu-rep" --page details > "$OUT/stalls_details.txt"
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass | gzip > "$OUT/stalls.csv.gz"
ls -la "$OUT"

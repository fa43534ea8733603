#!/usr/bin/env bash
# Where a launch's warps wait, per SASS instruction: Nsight Compute's warp-state sampling of one launch (the second,
# so that the first launch's cold caches and module load stay out), with the memory workload (L2 hit rate,
# throughput), exported as the source page's CSV (one row per instruction with its stall samples by reason) and the
# details page. Read the CSV here with `python tools/stall_summary.py $FILES/stalls.csv.gz`.
#   run (GPU machine, carry .whl):
#     bash tools/gpu/stall_profile.sh LAYERS scalar|mma T [--weights PRESET]   a decode launch of profile_step.py
#     bash tools/gpu/stall_profile.sh attention CONTEXT [--kv-cache int8]     the attention phase alone
#                                                                            (attention_phase.py)
# Writes $OUT/stalls.csv.gz, $OUT/stalls_details.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}
. tools/gpu/env.sh
if [ "$1" = attention ]; then
  kernel=mk_phase
  program=("$REPO/tools/gpu/attention_phase.py" --context "$2" --launches 2 --warmup-s 0 --out /tmp "${@:3}")
else
  kernel=mk_decode
  program=("$REPO/tools/gpu/profile_step.py" "$1" "$2" "$3" "$3" "${@:4}")
fi
rep=/tmp/stalls
ncu --clock-control none --kernel-name "$kernel" --launch-skip 1 --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section SchedulerStats --section Occupancy \
  --section LaunchStats --section MemoryWorkloadAnalysis --import-source no -f -o "$rep" \
  python3 "${program[@]}" || exit
ncu -i "$rep.ncu-rep" --page details > "$OUT/stalls_details.txt"
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass | gzip > "$OUT/stalls.csv.gz"
ls -la "$OUT"

#!/usr/bin/env bash
# Where the decode attention phase's warps wait: Nsight Compute's warp-state sampling of one launch of the phase alone
# (attention_phase.py's second, so that the first launch's module load stays out) at one context, with the memory
# workload (L2 hit rate, throughput), exported as the source page's CSV and the details page. Read the CSV here with
# `python tools/stall_summary.py $FILES/att_stalls.csv.gz`.
#   run (GPU machine, carry .whl): bash tools/gpu/attention_stalls.sh CONTEXT [--kv-cache int8]
# Writes $OUT/att_stalls.csv.gz, $OUT/att_stalls_details.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}
. tools/gpu/env.sh
context=$1
shift
rep=/tmp/att_stalls
ncu --clock-control none --kernel-name mk_phase --launch-skip 1 --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  --import-source no -f -o "$rep" \
  python3 "$REPO/tools/gpu/attention_phase.py" --context "$context" --launches 2 --out /tmp "$@" || exit
ncu -i "$rep.ncu-rep" --page details > "$OUT/att_stalls_details.txt"
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass | gzip > "$OUT/att_stalls.csv.gz"
ls -la "$OUT"

#!/usr/bin/env bash
# Speculative decoding on agent-like work, on the GPU machine's megakernel (issue 25), in one call:
#   run: bash tools/gpu/spec_workloads.sh          carry: [".data/default_model/spec_prompts"]
# For each workload (edit, complete, mixed) `onestream eval spec --workload W` on the embedded model, greedy:
# plain decoding, then MTP alone (k = 3), prompt lookup alone and the combination, each checked identical to
# plain greedy; mean accepted length, accepted per position, drafts by source and tok/s, as JSON in $OUT.
# The held-out files: the 12 exported by `python -m tools.default_model.evaluate --export-prompts
# .data/default_model/spec_prompts` (the GPU machine's packages may differ from the corpus' versions, so
# the model's corpus list may find fewer of them there); without that folder, whatever the list finds.
# The megakernel verifies at most 8 tokens per launch, so the lookup drafts at most 7 there. SPEC_ARGS: more
# `eval spec` options (e.g. "--drafting combined --no-extend-mtp": the combination without MTP drafts' copies).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}
REPO=$PWD
FILES=()
if [ -d .data/default_model/spec_prompts ]; then
  for f in .data/default_model/spec_prompts/*; do [ "$(basename "$f")" = SOURCES.txt ] || FILES+=("$REPO/$f"); done
fi

. tools/gpu/env.sh  # the package layout and carried wheels (gguf); leaves us in the link tree

{
  echo "== $(date -u +%FT%TZ) sources $(bash "$REPO/tools/gpu/tree_hash.sh" "$REPO")"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
} 2>&1 | tee "$OUT/env.log"
for workload in ${WORKLOADS:-edit complete mixed}; do
  echo "== workload $workload" | tee -a "$OUT/env.log"
  timeout "${SPEC_TIMEOUT:-170}" python3 -m onestream eval spec --workload "$workload" --backend megakernel \
    --device cuda --k ${K:-3} --max-prompts ${MAX_PROMPTS:-12} --prompts-per-file 1 --max-tokens 64 --json \
    ${SPEC_ARGS:-} "${FILES[@]}" > "$OUT/spec_$workload.json" 2> "$OUT/spec_$workload.err"
  echo "exit: $?" | tee -a "$OUT/env.log"
done

#!/usr/bin/env bash
# Issue 21's correctness bar on quantized weights, in one device call: `onestream eval kld --backend megakernel
# --against reference` (the fp32 reference on the same quantized weights: --quantize applies to both sides) for
#   - embedded: the embedded model quantized on load to Q4_K_M and to Q8_0 (its 384-wide rows take llama.cpp's
#     32-block fallbacks), over held-out tokens (.data/eval/heldout_tokens.txt, tools/gpu/README.md);
#   - conditioned: the conditioned random model (worker/testing.write_conditioned_checkpoint: 8 layers, every row a
#     multiple of 256, scaled like a trained model), written by our GGUF writer as Q4_K_M (Q4_K and Q6_K tensors,
#     llama.cpp's order), quantized on load to Q5_K_M (Q5_K, Q6_K) and to Q8_0 -- every K-quant path -- and run
#     unquantized (bf16: what the kernel's own bf16 roundings cost on this model, no quantization involved);
#   - control: the unconditioned random model of `random_weights` (4 layers, the same shapes; huge logits, each
#     layer's update several times the residual stream), GGUF Q4_K_M: what the conditioning changes.
#   The random models' vocabulary is the embedded model's size, so the same token file serves.
#   run: bash tools/gpu/quant_kld.sh   (carry .data/eval; KLD_LIMIT positions per run, KLD_TIMEOUT seconds per
#        run, KLD_ROWS the groups to run (default "embedded conditioned control"), CONTROL_LIMIT the control's
#        positions (default KLD_LIMIT))
# The megakernel runs one decode step per token and needs no prefill: ONESTREAM_PREFILL=reference spares each run
# the fast prefill's Triton probe.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache} ONESTREAM_PREFILL=reference
. tools/gpu/env.sh  # leaves us in the link tree
TOKENS=${KLD_TOKENS:-$REPO/.data/eval/heldout_tokens.txt}
LIMIT=${KLD_LIMIT:-12288}
ROWS=" ${KLD_ROWS:-embedded conditioned control} "
RANDOM_DIR=/tmp/onestream-random256
python3 - "$RANDOM_DIR" "$ROWS" <<'PY'
import sys
from pathlib import Path

import torch

from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.checkpoints.gguf_writer import write_gguf
from onestream.worker.testing import conditioned_config, write_conditioned_checkpoint, write_tiny_checkpoint

out, rows = Path(sys.argv[1]), sys.argv[2].split()
out.mkdir(parents=True, exist_ok=True)
if "conditioned" in rows:
    # bf16 on disk: the unquantized row then runs the same weights on both sides (the kernel streams bf16)
    source = write_conditioned_checkpoint(out / "conditioned", seed=21, dtype=torch.bfloat16)
    write_gguf(open_checkpoint(source), out / "conditioned_q4_k_m.gguf", preset="q4_k_m", device="cuda")
if "control" in rows:  # the random model issue 21 first measured: these shapes, 4 layers, seed 21
    source = write_tiny_checkpoint(out / "unconditioned", config=conditioned_config(num_hidden_layers=4), seed=21)
    write_gguf(open_checkpoint(source), out / "unconditioned_q4_k_m.gguf", preset="q4_k_m", device="cuda")
print(f"random models under {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
PY
run() {  # NAME LIMIT ARGS...: one KLD run, its log in $OUT/kld_NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== eval kld $name (limit $limit): $*"
  timeout "${KLD_TIMEOUT:-60}" python3 -m onestream eval kld --backend megakernel --against reference \
    --tokens "$TOKENS" --limit "$limit" --ctx 512 "$@" 2>&1 | tee "$OUT/kld_$name.log"
  echo "kld $name exit: ${PIPESTATUS[0]}"
}
if [[ $ROWS == *" embedded "* ]]; then
  run embedded_q4_k_m "$LIMIT" --quantize q4_k_m
  run embedded_q8_0 "$LIMIT" --quantize q8_0
fi
if [[ $ROWS == *" conditioned "* ]]; then
  run conditioned_gguf_q4_k_m "$LIMIT" --model "$RANDOM_DIR/conditioned_q4_k_m.gguf"
  run conditioned_q8_0 "$LIMIT" --model "$RANDOM_DIR/conditioned" --quantize q8_0
  run conditioned_q5_k_m "$LIMIT" --model "$RANDOM_DIR/conditioned" --quantize q5_k_m
  run conditioned_bf16 "$LIMIT" --model "$RANDOM_DIR/conditioned"
fi
if [[ $ROWS == *" control "* ]]; then
  run unconditioned_gguf_q4_k_m "${CONTROL_LIMIT:-$LIMIT}" --model "$RANDOM_DIR/unconditioned_q4_k_m.gguf"
fi

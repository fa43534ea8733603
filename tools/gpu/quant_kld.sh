#!/usr/bin/env bash
# Issue 21's correctness bar on quantized weights, in one device call: `onestream eval kld --backend megakernel
# --against reference` (the fp32 reference on the same quantized weights: --quantize applies to both sides) for
#   - the embedded model quantized on load to Q4_K_M and to Q8_0 (its 384-wide rows take llama.cpp's 32-block
#     fallbacks), over held-out tokens (.data/eval/heldout_tokens.txt, tools/gpu/README.md);
#   - a random model whose rows are all multiples of 256 (every K-quant path; 2 key and 4 value heads), written by
#     our GGUF writer as Q4_K_M in llama.cpp's order (ssm_out's tiled columns), and quantized on load to Q8_0;
#     its vocabulary is the embedded model's size, so the same token file serves.
#   run: bash tools/gpu/quant_kld.sh   (carry .whl and .data/eval; KLD_LIMIT positions, KLD_TIMEOUT per run)
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
RANDOM_DIR=/tmp/onestream-random256
python3 - "$RANDOM_DIR" <<'PY'
import sys
from pathlib import Path

from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.checkpoints.gguf_writer import write_gguf
from onestream.worker.testing import tiny_config, write_tiny_checkpoint

out = Path(sys.argv[1])
config = tiny_config(
    vocab_size=8192, hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
    head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=8192,
)  # fmt: skip
source = write_tiny_checkpoint(out / "hf", config=config, seed=21)
write_gguf(open_checkpoint(source), out / "q4_k_m.gguf", preset="q4_k_m", device="cuda")
print(f"random model: {out}/hf and {out}/q4_k_m.gguf")
PY
run() {  # NAME ARGS...: one KLD run, its log in $OUT/kld_NAME.log
  local name=$1
  shift
  echo "== eval kld $name: $*"
  timeout "${KLD_TIMEOUT:-60}" python3 -m onestream eval kld --backend megakernel --against reference \
    --tokens "$TOKENS" --limit "$LIMIT" --ctx 512 "$@" 2>&1 | tee "$OUT/kld_$name.log"
  echo "kld $name exit: ${PIPESTATUS[0]}"
}
run embedded_q4_k_m --quantize q4_k_m
run embedded_q8_0 --quantize q8_0
run random256_gguf_q4_k_m --model "$RANDOM_DIR/q4_k_m.gguf"
run random256_q8_0 --model "$RANDOM_DIR/hf" --quantize q8_0

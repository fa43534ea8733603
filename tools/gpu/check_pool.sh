#!/usr/bin/env bash
# The pool on a real GPU, in one device call: the reference model's CUDA tests, then `onestream serve` with a
# Ray card on the GPU (num_gpus=1, megakernel back end), two turns of one session through the gRPC client,
# `onestream status`, a scrape of the card's /metrics, and a SIGTERM drain.
#   run (carry .devpkgs): bash tools/gpu/check_pool.sh [gguf]
# gguf: skip the CUDA tests; quantize the embedded model to Q4_K_M on the device and serve that .gguf file on the
# megakernel back end (issue 21, "In the pool": the card's onestream_card_info must name the quantization).
# .devpkgs is made here: `../shared/tools/ray-bundle.sh .devpkgs`, plus the gRPC health and reflection services,
# which the GPU image lacks: `pip download --no-deps --only-binary=:all: --python-version 3.12 -d .devpkgs
# "grpcio-health-checking==1.84.0" "grpcio-reflection==1.84.0"` (1.84.0: the
# grpcio there; later wheels refuse to load on it).
set -uo pipefail
MODE=${1:-embedded}
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/onestream-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}
REPO=$PWD

. tools/gpu/ray_env.sh  # Ray from .devpkgs, then env.sh; leaves us in the link tree

echo "== $(date -u +%FT%TZ) sources $(bash "$REPO/tools/gpu/tree_hash.sh" "$REPO")" | tee "$OUT/pool.log"
SERVE_ARGS=()
if [ "$MODE" = gguf ]; then
  timeout 120 python3 -m onestream quantize --type q4_k_m --device cuda --out /tmp/embedded-q4_k_m.gguf 2>&1 |
    tail -3 | tee -a "$OUT/pool.log"
  SERVE_ARGS=(--model /tmp/embedded-q4_k_m.gguf --backend megakernel)
  READY_WAIT=${READY_WAIT:-300}  # the card compiles a megakernel build per tokens-per-launch for the file's formats
else
  timeout 120 python3 -m pytest -q -rA -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" -m gpu \
    "$REPO/tests/test_model_parity.py" "$REPO/tests/test_loading.py" 2>&1 | tail -15 | tee -a "$OUT/pool.log"
fi

python3 -m onestream serve "${SERVE_ARGS[@]}" --listen 127.0.0.1:50051 --metrics 127.0.0.1:9400 > "$OUT/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq "${READY_WAIT:-120}"); do grep -q "ready" "$OUT/serve.log" && break; sleep 1; done
cat "$OUT/serve.log" | grep -v WARNING | tee -a "$OUT/pool.log"
for turn in "def read_config(path):" "def read_config(path):
    with open(path) as f:"; do
  timeout 60 python3 -m onestream generate --server 127.0.0.1:50051 --session gpu-1 --max-tokens 64 \
    --prompt "$turn" 2>&1 | tail -4 | tee -a "$OUT/pool.log"
done
timeout 30 python3 -m onestream status --server 127.0.0.1:50051 2>&1 | tee -a "$OUT/pool.log"
card=$(grep -o "http://[^ ]*/metrics" "$OUT/serve.log" | tail -1)
python3 - "$card" <<'PY' 2>&1 | tee -a "$OUT/pool.log"
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
print("\n".join(line for line in text.splitlines() if line.startswith(("onestream_generation_tokens_total",
      "onestream_spec_decode_num_accepted_tokens_total", "onestream_card_info"))))
PY
kill -TERM "$SERVE"; wait "$SERVE"; echo "serve exit: $?" | tee -a "$OUT/pool.log"

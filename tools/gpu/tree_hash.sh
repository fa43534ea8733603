#!/usr/bin/env bash
# A fingerprint of the sources a device call runs: the SHA-1 of the sorted per-file SHA-1s of the repository's
# Python, CUDA and shell sources and pyproject.toml. The device's copy of the working tree carries no history of
# its own (its git HEAD is not the checkout's), so the logs print this instead; here, in a checkout of the commit
# a log names, `bash tools/gpu/tree_hash.sh` prints the same value where the sources are the same.
#   bash tools/gpu/tree_hash.sh [REPO]
set -euo pipefail
cd "${1:-$(dirname "$0")/../..}"
find onestream worker kernels cluster protos tools tests deploy pyproject.toml -type f \
  \( -name '*.py' -o -name '*.cu' -o -name '*.cuh' -o -name '*.sh' -o -name '*.proto' -o -name pyproject.toml \) \
  -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-12

#!/usr/bin/env bash
# Regenerates the Python code of the onestream.v1 protos (checked in next to the .proto files).
#   protos/generate.sh            writes into protos/
#   protos/generate.sh OUT_DIR    writes into OUT_DIR/onestream/v1/ (the regeneration check uses this)
# Needs grpcio-tools==1.84.* (pinned in pyproject's dev extras): code from a newer protoc may not load
# on the GPU machine's grpcio/protobuf. Runs $PYTHON (default: python; activate the venv first).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here}"
python="${PYTHON:-python}"
version="$("$python" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))')"
case "$version" in
  1.84.*) ;;
  *) echo "protos/generate.sh: grpcio-tools $version found; the checked-in code comes from 1.84.*" >&2; exit 1 ;;
esac
mkdir -p "$out/onestream/v1"
"$python" -m grpc_tools.protoc -I "$here" \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  "$here"/onestream/v1/*.proto
# protoc writes `from onestream.v1 import x_pb2`; the package installs as onestream.protos.onestream.v1,
# so the stubs import their messages relatively.
# The stubs refuse grpcio older than the generating grpcio-tools; any 1.84 patch release runs them (the
# GPU machine's grpcio is a 1.84), so they ask for 1.84.0.
for f in "$out"/onestream/v1/*_pb2_grpc.py; do
  sed -i -E -e 's/^from onestream\.v1 import ([a-z0-9_]+_pb2) as /from . import \1 as /' \
    -e "s/^GRPC_GENERATED_VERSION = '1\.84\.[0-9]+'/GRPC_GENERATED_VERSION = '1.84.0'/" "$f"
done

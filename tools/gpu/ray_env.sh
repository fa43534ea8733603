# Sourced by the tools/gpu scripts that start the pool, from the repository root, on the GPU machine. Ray is not
# installed there: unpack the slim bundle and the gRPC health / reflection wheels carried in .devpkgs (check_pool.sh's
# header says how it is made) into /tmp/site, put it on PYTHONPATH, then source env.sh (the package layout and the
# carried wheels; it leaves the shell in the link tree).
mkdir -p /tmp/site && tar -xJf .devpkgs/ray-slim.tar.xz -C /tmp/site &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .devpkgs/*.whl || exit 1
export PYTHONPATH=/tmp/site
. tools/gpu/env.sh

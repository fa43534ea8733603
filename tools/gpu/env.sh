# Sourced by the tools/gpu scripts, from the repository root, on the GPU machine. That machine has torch, cupy
# and triton but neither this project nor its pure-Python dependencies (gguf, which worker/quant reads its type
# tables from, is one): expose pyproject.toml's package layout (onestream.kernels -> kernels/, ...) through
# links, and unpack every wheel carried in .whl/ (pure-Python wheels: unpacking is installing). Make .whl here
# with `pip download --no-deps -d .whl gguf` and name it in the device call's carry.
# Sets REPO (the checkout) and PKG (the link tree), puts both the link tree and the wheels on PYTHONPATH, and
# leaves the shell in PKG: `python -m` puts the working directory first on sys.path, and the checkout's own
# onestream/ (without kernels/, worker/, ...) would shadow the linked package.
REPO=$PWD
PKG=${ONESTREAM_PKG:-/tmp/onestream-pkg}  # its own per process when several scripts run at once
SITE=${PKG}-wheels
rm -rf "$PKG" "$SITE" && mkdir -p "$PKG/onestream" "$SITE"
cp -r onestream/. "$PKG/onestream/"
for part in kernels worker cluster protos; do ln -s "$REPO/$part" "$PKG/onestream/$part"; done
for wheel in .whl/*.whl; do
  [ -f "$wheel" ] && python3 -m zipfile -e "$wheel" "$SITE"
done
python3 -c "import gguf" 2>/dev/null || PYTHONPATH="$SITE" python3 -c "import gguf" 2>/dev/null ||
  echo "tools/gpu/env.sh: the gguf package is missing; carry it in .whl (pip download --no-deps -d .whl gguf)" >&2
export PYTHONPATH="$PKG:$SITE${PYTHONPATH:+:$PYTHONPATH}"
cd "$PKG" || return 1

#!/usr/bin/env bash
# Runs the project's pinned uv (requirements/uv.txt, hash-checked), installing it once into the
# shared cache. Every Python install of the project goes through this: `scripts/uv.sh sync ...`.
#   LLMBATCH_CACHE   shared cache (default ~/.cache/llmbatch): uv itself, uv's download/build cache
#   UV_CACHE_DIR     uv's cache (default $LLMBATCH_CACHE/uv; hard-linked into each checkout's .venv)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${LLMBATCH_CACHE:-$HOME/.cache/llmbatch}
version=$(sed -n 's/^uv==\([^ ]*\).*/\1/p' "$ROOT/requirements/uv.txt")
tool="$CACHE/tools/uv-$version"
if [ ! -x "$tool/bin/uv" ]; then
  py=${LLMBATCH_PYTHON:-python3.11}
  command -v "$py" >/dev/null 2>&1 || py=python3
  printf '[uv] installing uv %s (hash-checked) into %s (first time only; ~5 s)\n' "$version" "$tool" >&2
  rm -rf "$tool.tmp"
  "$py" -m venv "$tool.tmp"
  "$tool.tmp/bin/pip" install --disable-pip-version-check -q --require-hashes --no-deps \
    -r "$ROOT/requirements/uv.txt"
  rm -rf "$tool" && mv "$tool.tmp" "$tool"
  # the venv's scripts carry the .tmp path in their shebang; uv is a binary, so it does not matter
fi
export UV_CACHE_DIR=${UV_CACHE_DIR:-$CACHE/uv}
export UV_PYTHON=${UV_PYTHON:-${LLMBATCH_PYTHON:-python3.11}}
export UV_PYTHON_DOWNLOADS=never   # only PyPI is reachable; use the machine's Python 3.11
export UV_LINK_MODE=${UV_LINK_MODE:-hardlink}
exec "$tool/bin/uv" "$@"

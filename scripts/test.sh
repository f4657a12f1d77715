#!/usr/bin/env bash
# The whole test suite on a fresh machine: system packages, .venv, then every tier of pytest.
# Fast tiers only: scripts/test.sh -m "not engine and not docker and not systemd"
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ]; then
  scripts/setup-system.sh
fi
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"

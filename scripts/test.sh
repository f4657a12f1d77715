#!/usr/bin/env bash
# The whole test suite on a fresh machine: system packages, .venv, lint, then every tier of pytest.
# Fast tiers only: scripts/test.sh -m "not engine and not docker and not systemd"
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ]; then
  scripts/setup-system.sh
fi
scripts/setup.sh
# Lint and formatting first: a minute saved for a style slip, before the slow tiers start.
.venv/bin/ruff check appliance tests benchmarks
.venv/bin/ruff format --check appliance tests benchmarks
exec .venv/bin/python -m pytest "$@"

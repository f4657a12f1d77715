#!/usr/bin/env bash
# The whole test suite on a fresh machine: system packages, .venv, lint, then every tier of pytest.
# Fast tiers only: scripts/test.sh -m "not engine and not docker and not systemd"
# With arguments, one pytest runs them. Without, the suite runs as two streams side by side
# (tests/conftest.py: the booted systemd machines' tests, and the rest), each line of output
# prefixed with its stream; the run fails if either fails. APPLIANCE_TEST_STREAMS=1: one pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ]; then
  scripts/setup-system.sh
fi
scripts/setup.sh
# Lint and formatting first: a minute saved for a style slip, before the slow tiers start.
.venv/bin/ruff check appliance tests benchmarks
.venv/bin/ruff format --check appliance tests benchmarks
if [ "$#" -gt 0 ] || [ "${APPLIANCE_TEST_STREAMS:-2}" = 1 ]; then
  exec .venv/bin/python -m pytest "$@"
fi

# One stream: pytest for its tests, every line prefixed (sed -u: lines appear as they end).
run_stream() {
  set -o pipefail
  .venv/bin/python -m pytest --stream "$1" --durations=20 2>&1 | sed -u "s/^/[$1] /"
}
run_stream machines &
machines=$!
# Stopped with the run (Ctrl-C, CI's timeout): the machines stream goes down with it.
trap 'pkill -f -- "pytest --stream machines" || true' EXIT
set +e
run_stream host
host_rc=$?
wait "$machines"
machines_rc=$?
trap - EXIT
echo "streams: host exit ${host_rc}, machines exit ${machines_rc}"
[ "$host_rc" = 0 ] && [ "$machines_rc" = 0 ]

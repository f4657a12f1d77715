#!/usr/bin/env bash
# The whole test suite on a fresh machine: system packages, .venv, lint, then every tier of pytest.
# Fast tiers only: scripts/test.sh -m "not engine and not docker and not systemd"
# With arguments, one pytest runs them. Without, the suite runs as two streams side by side
# (tests/conftest.py: the booted systemd machines' tests, and the rest), each line of output
# prefixed with its stream; the run fails if either fails. APPLIANCE_TEST_STREAMS=1: one pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Before any of the run's work: how fast the host runs Python now (runs' times vary with it).
host_speed="$(python3 benchmarks/host_speed.py)"
echo "$host_speed"
root=0
[ "$(id -u)" = 0 ] && root=1
if [ "$root" = 1 ] && { [ "$#" -gt 0 ] || [ "${APPLIANCE_TEST_STREAMS:-2}" = 1 ]; }; then
  scripts/setup-system.sh
fi
# Some hosts set this for every process: then each Python process of the run (vLLM's three per
# engine start among them) compiled its modules again instead of reading the bytecode cache.
unset PYTHONDONTWRITEBYTECODE
lint() {
  .venv/bin/ruff check appliance tests benchmarks
  .venv/bin/ruff format --check appliance tests benchmarks
}
if [ "$#" -gt 0 ] || [ "${APPLIANCE_TEST_STREAMS:-2}" = 1 ]; then
  scripts/setup.sh
  lint
  exec .venv/bin/python -m pytest "$@"
fi

# The cold work starts first, in the background (tests/prefetch.py): the two rootfs and wheel
# downloads beside the venv's install, then the images, tiny models and npm schema beside the
# lint and the first tests. The fixtures that need a piece wait for it.
run_dir="$(mktemp -d)"
# Stopped with the run (Ctrl-C, CI's timeout): what this run started goes down with it, nothing
# else on the machine. The streams get SIGINT, so that pytest tears its machines and engines down
# (tests/conftest.py takes it back from the shell, which ignores it in background jobs).
stop() {
  local f
  for f in "$run_dir"/*.pid; do
    case "$f" in
      */prefetch-*) kill -TERM "$(cat "$f")" 2>/dev/null ;;
      *) kill -INT "$(cat "$f")" 2>/dev/null ;;
    esac
  done
  return 0
}
trap stop EXIT
# System packages in two halves: what the venv and the rootfs bootstraps need first, then the rest
# (Docker, Chromium, Prometheus: most of apt's time on a new machine) beside the venv's install.
if [ "$root" = 1 ]; then
  scripts/setup-system.sh first
  scripts/setup-system.sh rest > "$run_dir/apt-rest.log" 2>&1 &
  apt_rest=$!
fi
python3 tests/prefetch.py system > "$run_dir/prefetch-system.log" 2>&1 &
echo $! > "$run_dir/prefetch-system.pid"
scripts/setup.sh
if [ "$root" = 1 ] && ! wait "$apt_rest"; then
  cat "$run_dir/apt-rest.log"
  exit 1
fi
tail -1 "$run_dir/apt-rest.log" 2>/dev/null || true
.venv/bin/python tests/prefetch.py venv > "$run_dir/prefetch-venv.log" 2>&1 &
echo $! > "$run_dir/prefetch-venv.pid"
lint

# One stream: pytest for its tests, every line prefixed (sed -u: lines appear as they end).
run_stream() {
  .venv/bin/python -m pytest --stream "$1" --durations=20 > >(sed -u "s/^/[$1] /") 2>&1 &
  echo $! > "$run_dir/$1.pid"
  wait $!
}
tests_start=$SECONDS
run_stream machines &
machines=$!
set +e
run_stream host
host_rc=$?
wait "$machines"
machines_rc=$?
set -e
trap - EXIT
wait
cat "$run_dir"/prefetch-*.log
rm -rf "$run_dir"
took() { echo "$(( $1 / 60 )) min $(( $1 % 60 )) s"; }
echo "streams: host exit ${host_rc}, machines exit ${machines_rc}; setup and lint $(took "$tests_start"), tests $(took $((SECONDS - tests_start))), whole run $(took "$SECONDS"); ${host_speed}"
[ "$host_rc" = 0 ] && [ "$machines_rc" = 0 ]

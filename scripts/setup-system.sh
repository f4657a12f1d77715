#!/usr/bin/env bash
# System packages the full test suite uses: Docker engine, systemd-nspawn + mmdebstrap,
# Prometheus/promtool, Alertmanager/amtool, shellcheck, Chromium (the HTML reports' browser test), the distribution's
# venv module (scripts/setup.sh), strace (the history's fsync test), Node.js (when absent). Needs
# root (apt). Idempotent.
# Usage: scripts/setup-system.sh [first|rest]  (default: both)
#   first: what scripts/setup.sh and the suite's first background work need (the venv module,
#          mmdebstrap, systemd-nspawn); rest: the others, which scripts/test.sh installs
#          beside the venv's install.
set -euo pipefail
first=(python3-venv mmdebstrap systemd-container strace)
rest=(docker.io prometheus prometheus-alertmanager shellcheck chromium)
# Node.js + npm check the dashboards against Grafana's published schema types (tsc).
command -v npm >/dev/null 2>&1 || rest+=(nodejs npm)
case "${1:-all}" in
  first) packages=("${first[@]}") ;;
  rest) packages=("${rest[@]}") ;;
  all) packages=("${first[@]}" "${rest[@]}") ;;
  *) echo "usage: $0 [first|rest]" >&2; exit 2 ;;
esac
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  # One package list per run: the second half reuses the first's when it is under an hour old.
  if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mmin -60 2>/dev/null)" ]; then
    apt-get update -q
  fi
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# apt starts no services here; the test fixtures start dockerd and Prometheus themselves.
systemctl disable --now prometheus prometheus-alertmanager >/dev/null 2>&1 || true
echo "system packages ready: ${packages[*]}"

#!/usr/bin/env bash
# System packages the full test suite uses: Docker engine, systemd-nspawn + debootstrap,
# Prometheus/promtool, shellcheck, Chromium (the HTML reports' browser test), the distribution's
# venv module (scripts/setup.sh), Node.js (when absent). Needs root (apt). Idempotent.
set -euo pipefail
packages=(docker.io systemd-container debootstrap prometheus shellcheck chromium python3-venv)
# Node.js + npm check the dashboards against Grafana's published schema types (tsc).
command -v npm >/dev/null 2>&1 || packages+=(nodejs npm)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# apt starts no services here; the test fixtures start dockerd and Prometheus themselves.
systemctl disable --now prometheus >/dev/null 2>&1 || true
echo "system packages ready: ${packages[*]}"

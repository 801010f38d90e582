#!/usr/bin/env bash
# Install the Debian packages the test suite needs and pip cannot provide: prometheus (and its promtool), which
# tests/integration/test_prometheus_rules.py runs against a real daemon to check deploy/prometheus and deploy/grafana.
# Safe to re-run: installs only what is missing. Needs root (or sudo) and apt-get.
#
# Usage: scripts/install_system_packages.sh [--check]   (--check: exit 1 listing what is missing, install nothing)
set -euo pipefail

packages=(prometheus)
commands=(prometheus)

missing=()
for i in "${!packages[@]}"; do
  command -v "${commands[$i]}" >/dev/null 2>&1 || missing+=("${packages[$i]}")
done
if [[ ${#missing[@]} == 0 ]]; then
  exit 0
fi
if [[ "${1:-}" == "--check" ]]; then
  echo "missing Debian packages: ${missing[*]} (scripts/install_system_packages.sh installs them)" >&2
  exit 1
fi
sudo=""
[[ $(id -u) != 0 ]] && sudo="sudo"
echo "installing Debian packages: ${missing[*]}" >&2
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"

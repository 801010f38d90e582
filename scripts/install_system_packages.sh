#!/usr/bin/env bash
# Install the Debian packages the test suite needs and pip cannot provide: prometheus (and its promtool), which
# tests/integration/test_prometheus_rules.py runs against a real daemon to check deploy/prometheus and deploy/grafana;
# postgresql and haproxy, which tests/integration/test_scale_out.py and scripts/bench_scale_out.py run (the shared
# session journal and the proxy of deploy/haproxy); libopenblas0-pthread, the optimised CBLAS the daemon's MLX
# backend loads on Linux (--mlx-blas auto), which tests/integration/test_mlx_blas.py runs; gcc, which builds the
# compiled kernels of the torch backend (kv_cache_proposer/backends/torch_backend/held_kernel.c, dense_kernel.c and
# products.c) that
# tests/kv_cache_proposer/backends/test_held_attention.py and test_products.py run. The tests start their own
# servers on loopback; the package's own PostgreSQL cluster service is not needed.
# Safe to re-run: installs only what is missing. Needs root (or sudo) and apt-get.
#
# Usage: scripts/install_system_packages.sh [--check]   (--check: exit 1 listing what is missing, install nothing)
set -euo pipefail

packages=(prometheus postgresql haproxy libopenblas0-pthread gcc)
# A file each package installs: the PostgreSQL server binaries live under /usr/lib/postgresql/<version>/bin, off PATH.
installed() {
  case "$1" in
    prometheus) command -v prometheus >/dev/null 2>&1 ;;
    postgresql) compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null ;;
    haproxy) command -v haproxy >/dev/null 2>&1 || [[ -x /usr/sbin/haproxy ]] ;;
    libopenblas0-pthread) compgen -G "/usr/lib/*/openblas-pthread/libopenblas.so.0" >/dev/null ;;
    gcc) command -v gcc >/dev/null 2>&1 ;;
  esac
}

missing=()
for package in "${packages[@]}"; do
  installed "$package" || missing+=("$package")
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

#!/usr/bin/env bash
# Install the servers scripts/bench_agentic/bench_vs_peers.py measures the daemon against. For that bench only:
# no test or CI job needs them.
#
# - llama.cpp's native `llama-server`, built with CMake from the llama.cpp source vendored in the PyPI source
#   distribution of llama-cpp-python (only the llama-server target, native CPU flags, static libraries), under
#   $KAKEYA_PEERS_DIR (default ~/.cache/kakeya/peers). Skipped when that binary is already built.
# - mlx_lm.server, from the mlx-lm package in the active Python environment (installed there when missing).
#
# Prints the path and version of each. Needs cmake, a C++17 compiler and the package registry.
#
# Usage: scripts/bench_agentic/install_peers.sh [--jobs N]      (default: 2 parallel compile jobs)
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
PEERS_DIR="${KAKEYA_PEERS_DIR:-$HOME/.cache/kakeya/peers}"
SOURCE_DIR="$PEERS_DIR/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION"
BUILD_DIR="$SOURCE_DIR/vendor/llama.cpp/build"
LLAMA_SERVER="$BUILD_DIR/bin/llama-server"
JOBS=2
if [[ "${1:-}" == "--jobs" ]]; then
  JOBS="$2"
fi

cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python}"
[[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python

if [[ -x "$LLAMA_SERVER" ]]; then
  echo "llama-server already built: $LLAMA_SERVER" >&2
else
  for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "install_peers.sh needs $tool on PATH" >&2; exit 1; }
  done
  mkdir -p "$PEERS_DIR"
  download="$(mktemp -d)"
  trap 'rm -rf "$download"' EXIT
  echo "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION source distribution" >&2
  "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
    -d "$download"
  rm -rf "$SOURCE_DIR"
  tar -xzf "$download/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$PEERS_DIR"
  mv "$PEERS_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION" "$SOURCE_DIR"
  started=$SECONDS
  # No web UI (it would be fetched from the network), no HTTPS, static libraries so the binary stands alone.
  cmake -S "$SOURCE_DIR/vendor/llama.cpp" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF >&2
  cmake --build "$BUILD_DIR" --target llama-server -j "$JOBS" >&2
  echo "built llama-server in $((SECONDS - started)) s ($JOBS jobs)" >&2
fi
echo "llama-server: $LLAMA_SERVER"
"$LLAMA_SERVER" --version 2>&1 | sed 's/^/  /'

if ! "$PYTHON" -c "import mlx_lm.server" 2>/dev/null; then
  echo "installing mlx-lm into $("$PYTHON" -c 'import sys; print(sys.prefix)')" >&2
  "$PYTHON" -m pip install --quiet mlx-lm
fi
echo "mlx_lm.server: $("$PYTHON" -c 'import mlx_lm.server, mlx_lm; print(mlx_lm.server.__file__)')"
echo "  mlx-lm $("$PYTHON" -c 'import mlx_lm; print(mlx_lm.__version__)')"

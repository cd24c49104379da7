#!/usr/bin/env bash
# Build llama.cpp's `llama-server` for the side-by-side in benchmarks/http_load.py (--llama-server PATH).
# The source is the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI (a registry these machines
# reach); nothing is fetched from a model hub. About 15 minutes on 2 cores. Prints the binary's path.
#   usage: benchmarks/build_llama_server.sh [WORKDIR]   (default /tmp/llama-server-build)
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
WORK="${1:-/tmp/llama-server-build}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$WORK" && cd "$WORK"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$VERSION"
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
cd "llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON >&2
cmake --build build --target llama-server llama-batched-bench -j "$(nproc)" >&2
echo "$PWD/build/bin/llama-server"

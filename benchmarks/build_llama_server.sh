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
# The instruction sets are this CPU's, as GGML_NATIVE would pick them, but never AMX: some hosts here list
# amx_tile in /proc/cpuinfo yet fault on the first tile instruction (SIGILL in ggml's AMX matmul).
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)" \
  -DGGML_BMI2="$(has bmi2)" -DGGML_AVX_VNNI="$(has avx_vnni)" -DGGML_AVX512="$(has avx512f)" \
  -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)" \
  -DGGML_AVX512_BF16="$(has avx512_bf16)" >&2
cmake --build build --target llama-server llama-batched-bench -j "$(nproc)" >&2
echo "$PWD/build/bin/llama-server"

#!/usr/bin/env bash
# Builds upstream llama.cpp's `llama-speculative-simple` (its own DFlash loop: --spec-type
# draft-dflash) from the llama-cpp-python 0.3.36 sdist, i.e. the llama.cpp whose libllama we load,
# with the CPU flags our llama-cpp-python build uses (scripts/cpu-flags.sh), so that the two loops
# run the same kernels, and with llama.cpp's RPC backend (its `--rpc`: bench/bench_rpc.py runs it over
# a split; without `--rpc` it changes nothing).  Kept in $CACHE/upstream; about 6-8 minutes on 2
# cores the first time.
# Prints the binary's path.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${LLAMA_DFLASH_FILES:-${LLAMA_DFLASH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-dflash}}
dst="$CACHE/upstream"
bin="$dst/build-rpc/bin/llama-speculative-simple"
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
mkdir -p "$dst"
sdist="$dst/llama_cpp_python-0.3.36.tar.gz"
[ -f "$sdist" ] || python3 -m pip download -q --disable-pip-version-check --no-deps --no-build-isolation \
    --no-binary llama-cpp-python -d "$dst" "llama-cpp-python==0.3.36" >&2
if [ ! -f "$dst/src/vendor/llama.cpp/CMakeLists.txt" ]; then
    rm -rf "$dst/src" && mkdir -p "$dst/src"
    tar xzf "$sdist" -C "$dst/src" --strip-components=1
fi
# shellcheck disable=SC2046
cmake -S "$dst/src/vendor/llama.cpp" -B "$dst/build-rpc" -DCMAKE_BUILD_TYPE=Release $(bash scripts/cpu-flags.sh) -DGGML_RPC=ON \
    -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build "$dst/build-rpc" --target llama-speculative-simple -j "$(nproc)" >&2
echo "$bin"

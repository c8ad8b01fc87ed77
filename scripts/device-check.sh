#!/usr/bin/env bash
# The CUDA device check (issue 21), start to finish on a machine with an NVIDIA GPU, nvcc and no
# package index: build (scripts/setup.sh --cuda), the GPU tests, the CUDA benchmark.  It needs the
# repository plus .device/ (scripts/device-prep.sh, run where PyPI is reachable; ~7 MB).
#
#   scripts/device-check.sh [CC]      CC: the compute capability (default: the GPU's)
#
# Results go to $OUT (default /tmp/device-check): build.log, tests.log, bench.log, cuda.json; copy
# cuda.json to bench/results/ where it was measured.  Sized for one H200 with 16 cores: about
# 8 minutes, most of it compiling llama.cpp's CUDA kernels for the one architecture.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
t0=$SECONDS
say() { echo "[device-check +$((SECONDS - t0)) s] $*"; }
die() { say "FAILED: $*"; exit 1; }

[ -d .device/wheels ] || die "no .device/: run scripts/device-prep.sh where PyPI is reachable and carry .device"
nvidia-smi -L || die "no NVIDIA GPU visible"
command -v nvcc >/dev/null || die "nvcc is not on PATH"
CC=${1:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')}
PY=${PYTHON:-python3}
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.device/wheels" PIP_ROOT_USER_ACTION=ignore
export LLAMA_DFLASH_TOKENIZER_GGUF="$PWD/.device/smollm2-tokenizer.gguf"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) PYTHONUNBUFFERED=1

# cuBLAS: from the toolkit beside nvcc, else from the nvidia-cublas Python package.
cuda_root=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
if ! ls "$cuda_root"/lib64/libcublas.so* "$cuda_root"/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
    cb=$("$PY" -c "import nvidia.cublas as m; print(list(m.__path__)[0])" 2>/dev/null) \
        || die "no cuBLAS in $cuda_root and no nvidia-cublas Python package"
    lib=$(ls "$cb"/lib/libcublas.so.* | head -n 1)
    lt=$(ls "$cb"/lib/libcublasLt.so.* | head -n 1)
    export CMAKE_ARGS="-DCUDA_cublas_LIBRARY=$lib -DCUDA_cublasLt_LIBRARY=$lt -DCMAKE_CUDA_FLAGS=-I$cb/include -DCMAKE_CXX_FLAGS=-I$cb/include"
    export LD_LIBRARY_PATH="$cb/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    say "cuBLAS from $cb"
fi

say "build: scripts/setup.sh --cuda $CC"
timeout 420 scripts/setup.sh --cuda "$CC" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; die "build"; }
"$PY" -c "import llama_cpp; from llama_dflash.core.drafter import cuda_devices as c; \
assert llama_cpp.llama_supports_gpu_offload() and c() > 0, 'the CUDA build sees no device'; print('CUDA devices:', c())" \
    || die "the CUDA build"

say "tests: tests/test_cuda.py (the GPU tests included)"
timeout 240 "$PY" -m pytest -q -rs tests/test_cuda.py 2>&1 | tee "$OUT/tests.log" | tail -20
tests_rc=${PIPESTATUS[0]}

say "bench: bench/bench_cuda.py"
timeout 300 "$PY" bench/bench_cuda.py --out "$OUT/cuda.json" --workdir /tmp ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
say "done: tests rc $tests_rc, bench rc $bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]

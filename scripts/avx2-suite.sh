#!/usr/bin/env bash
# The README's test command as an AVX2-only CPU (AMD EPYC Zen 2) runs it, on any x86 machine with
# AVX2: llama-cpp-python built without AVX512 / AVX-VNNI (LLAMA_DFLASH_ISA=avx2, scripts/cpu-flags.sh)
# in a virtualenv of its own, and our kernels held to their AVX2 code (LLAMA_DFLASH_KERNELS_ISA).
# ggml and our kernels then compute what they compute on such a CPU, so exactness and every test
# are checked for that CPU class here too.  The build (about 6 minutes the first time) and the
# virtualenv live in $LLAMA_DFLASH_FILES/avx2; the models are linked from the main cache.
#
#   scripts/avx2-suite.sh [pytest arguments]      (default: -q tests)
set -euo pipefail
cd "$(dirname "$0")/.."
main=${LLAMA_DFLASH_FILES:-${LLAMA_DFLASH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-dflash}}
files="$main/avx2"
mkdir -p "$files"
grep -qw avx2 /proc/cpuinfo || { echo "avx2-suite.sh: this CPU has no AVX2" >&2; exit 2; }
# the downloaded and derived files that do not depend on the build: shared
for f in "$main"/*.gguf "$main"/dl "$main"/sdist "$main"/test-drafters "$main"/package-*.json; do
    [ -e "$f" ] && ln -sfn "$f" "$files/"
done
# (system site packages: torch and the other test extras come from the main install)
[ -x "$files/venv/bin/python" ] || python3 -m venv --system-site-packages "$files/venv"
export LLAMA_DFLASH_FILES="$files" PYTHON="$files/venv/bin/python" PATH="$files/venv/bin:$PATH"
export LLAMA_DFLASH_ISA=avx2 LLAMA_DFLASH_KERNELS_ISA=avx2 PIP_ROOT_USER_ACTION=ignore
scripts/setup.sh --test --rpc
python -c "import llama_cpp, sys; info = llama_cpp.llama_print_system_info().decode()
from llama_dflash.core import kernels
print(info.strip(), '|', kernels.describe())
sys.exit('AVX512 = 1' in info)"
if [ $# -eq 0 ]; then set -- -q tests; fi
python -m pytest "$@"

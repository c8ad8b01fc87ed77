#!/usr/bin/env bash
# Prints llama.cpp's CMake flags for this CPU: explicit ISA flags, no native build, no AMX (the
# native build enables AMX kernels that segfault on this CPU class).  Shared by setup.sh (the
# llama-cpp-python build) and bench/build-upstream.sh (upstream's examples, built alike).
flags="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
# LLAMA_DFLASH_ISA=avx2 builds for an AVX2-only CPU (AMD Zen 2) on any x86 CPU with AVX2: no AVX512,
# no AVX-VNNI
cpu=$(grep -m1 '^flags' /proc/cpuinfo || true)
[ "${LLAMA_DFLASH_ISA:-}" = avx2 ] && cpu=$(tr ' ' '\n' <<< "$cpu" | grep -v -e '^avx512' -e '^avx_vnni' | tr '\n' ' ')
has() { [[ " $cpu " == *" $1 "* ]]; }
has avx && flags="$flags -DGGML_AVX=ON"
has avx2 && flags="$flags -DGGML_AVX2=ON"
has fma && flags="$flags -DGGML_FMA=ON"
has f16c && flags="$flags -DGGML_F16C=ON"
has bmi2 && flags="$flags -DGGML_BMI2=ON"
has avx512f && flags="$flags -DGGML_AVX512=ON"
has avx512vbmi && flags="$flags -DGGML_AVX512_VBMI=ON"
has avx512_vnni && flags="$flags -DGGML_AVX512_VNNI=ON"
has avx512_bf16 && flags="$flags -DGGML_AVX512_BF16=ON"
has avx_vnni && flags="$flags -DGGML_AVX_VNNI=ON"
echo "$flags"

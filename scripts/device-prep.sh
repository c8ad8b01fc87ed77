#!/usr/bin/env bash
# Prepares .device/ (git-ignored) for scripts/device-check.sh on a GPU machine that reaches no
# package index: run it here, where PyPI is reachable, then carry .device with the repository.
#
#   .device/wheels/llama_cpp_python-0.3.36.tar.gz  the sdist without what its build never reads
#                                                  (llama.cpp's models, docs, tests, examples, ...)
#   .device/wheels/*.whl                           the packages the device image lacks (cp312)
#   .device/smollm2-tokenizer.gguf                 SmolLM2's tokenizer alone, for random-weight models
#
# The whole working tree that travels (tracked files + .device) must stay within 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEV_PY=${DEVICE_PYTHON:-3.12}   # the device image's Python
D=.device
rm -rf "$D"
mkdir -p "$D/wheels"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-build-isolation \
    --no-binary llama-cpp-python -d "$tmp" "llama-cpp-python==0.3.36"
tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
v="$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp"
rm -rf "$v"/{models,docs,benches,tests,examples,conversion,media,gguf-py,.github,scripts,grammars,prompts,requirements} \
       "$tmp/llama_cpp_python-0.3.36"/{.git,.github,examples,docker,docs,tests}
# backends a CUDA build does not enable (ggml adds a backend's folder only when it is enabled)
rm -rf "$v"/ggml/src/ggml-{et,metal,hexagon,sycl,vulkan,opencl,cann,webgpu,zdnn,openvino,virtgpu}
for t in "$v"/tools/*/; do [ "$(basename "$t")" = mtmd ] || rm -rf "$t"; done  # the build compiles mtmd alone
tar czf "$D/wheels/llama_cpp_python-0.3.36.tar.gz" -C "$tmp" llama_cpp_python-0.3.36

# what llama-dflash and its tests need beyond the device image (KINDS.md lists the image)
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$DEV_PY" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$D/wheels" cffi pycparser "gguf>=0.17" diskcache

"$PY" - "$D/smollm2-tokenizer.gguf" <<'PYEOF'
import sys
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from llama_dflash.api.models import smollm2_q4_1
r = GGUFReader(smollm2_q4_1())
w = GGUFWriter(sys.argv[1], "llama")
f = r.fields
w.add_tokenizer_model(f["tokenizer.ggml.model"].contents())
w.add_tokenizer_pre(f["tokenizer.ggml.pre"].contents())
w.add_token_list(f["tokenizer.ggml.tokens"].contents())
w.add_token_types(f["tokenizer.ggml.token_type"].contents())
w.add_token_merges(f["tokenizer.ggml.merges"].contents())
w.add_key_value("tokenizer.chat_template", f["tokenizer.chat_template"].contents(), GGUFValueType.STRING)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
PYEOF

tracked=$(git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f1)
extra=$(du -sb "$D" | cut -f1)
echo "prepared $D: $(du -sh "$D" | cut -f1); with the tracked files $(( (tracked + extra) / 1048576 )) MiB of the 64 MiB that travel"
[ $(( tracked + extra )) -le $(( 64 * 1048576 )) ] || { echo "device-prep.sh: over 64 MiB" >&2; exit 1; }

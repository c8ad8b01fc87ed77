"""One copy of libllama / libggml in the process, whatever is imported first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os, sys
order = sys.argv[1]
if order == "llama_cpp_first":
    import llama_cpp  # noqa
from llama_dflash import SpeculativeGenerator
import llama_cpp
g = SpeculativeGenerator(sys.argv[2], sys.argv[3], n_ctx=128)
r = g.generate("hello", 8)
libs = {}
for line in open("/proc/self/maps"):
    parts = line.split()
    if len(parts) >= 6 and "/lib" in parts[5]:
        base = os.path.basename(parts[5])
        for name in ("libllama", "libggml-base", "libggml-cpu", "libggml.", "libdflash"):
            if base.startswith(name):
                libs.setdefault(name, set()).add(os.path.realpath(parts[5]))
print(json.dumps({"libs": {k: sorted(v) for k, v in libs.items()}, "n": len(r.tokens),
                  "llama_cpp_lib": os.path.join(os.path.dirname(llama_cpp.__file__), "lib")}))
"""


@pytest.mark.parametrize("order", ["llama_dflash_first", "llama_cpp_first"])
def test_single_copy_of_native_libraries(artifacts, order):
    a = artifacts["llama"]
    out = subprocess.run([sys.executable, "-c", SCRIPT, order, a["target"], a["drafter"]],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["n"] == 8
    libdir = os.path.realpath(res["llama_cpp_lib"])
    for name in ("libllama", "libggml-base", "libggml-cpu", "libggml.", "libdflash"):
        paths = res["libs"].get(name, [])
        assert len(paths) == 1, f"{name}: mapped from {paths}"
        if name != "libdflash":
            assert os.path.dirname(paths[0]) == libdir, f"{name} not from llama_cpp/lib: {paths}"

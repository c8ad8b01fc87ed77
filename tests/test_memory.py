"""The drafter borrows the target's embedding and head: no second copy in RAM."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys
import llama_cpp
import numpy as np
from llama_dflash.core.drafter import Drafter
from llama_dflash.formats.gguf import DrafterConfig, random_drafter_tensors, write_drafter
from llama_dflash.api.models import default_target

def pss():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024

target = default_target("q8_0")
cfg = DrafterConfig(n_embd=576, n_layer=2, n_head=9, n_head_kv=3, head_dim=64, n_ff=1536,
                    target_layers=[1, 8, 14, 20, 27], block_size=8, mask_token_id=16, rope_theta=1e5)
path = sys.argv[1]
write_drafter(path, cfg, random_drafter_tensors(cfg), target, outtype="f16")
model = llama_cpp.llama_model_load_from_file(str(target).encode(), llama_cpp.llama_model_default_params())
# touch the whole target (as a generation would) before measuring
ctx_p = llama_cpp.llama_context_default_params(); ctx_p.n_ctx = 256
ctx = llama_cpp.llama_init_from_model(model, ctx_p)
b = llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 4)(1, 2, 3, 4), 4)
assert llama_cpp.llama_decode(ctx, b) == 0
before = pss()
d = Drafter(path, model, n_ctx=256, n_threads=2)
d.push(np.zeros((64, 5 * 576), np.float32))
for a in range(0, 49152, 997):  # embedding rows all over the table
    d.draft(a, 7)
    d.truncate(64)
after = pss()
print(json.dumps({"delta": after - before, **d.memory()}))
"""


def test_drafter_borrows_target_tables(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "d.gguf")], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["borrows_embedding"] and m["borrows_head"]
    own = m["weights"] + m["cache"] + m["compute"]
    assert m["borrowed"] > 25e6  # SmolLM2's tied Q8_0 embedding/head: 49152 x 576
    # What the drafter added is its own allocations (+ allocator slack), not a copy of the tables.
    assert m["delta"] < own + 4e6, m
    assert m["delta"] < own + 0.25 * m["borrowed"], m

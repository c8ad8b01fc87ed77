"""Converter peak memory on a synthetic multi-GB checkpoint (streaming check).

Writes a bf16 DFlash checkpoint of ~2.3 GB (hidden 4096, 5 layers, ffn 14336, 5 taps) and a
matching 2-layer target GGUF, converts it to f16 in a subprocess, and records the converter's
peak RSS next to the checkpoint size and the largest tensor.

Usage: python bench/bench_convert.py [--workdir /tmp/convbench] [--out bench/results/convert.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

H, L, FF, NQ, NKV, D, TAPS = 4096, 5, 14336, 32, 8, 128, [0, 1, 2, 3, 4]


def make_target(path: Path) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(6)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_feed_forward_length(256)
    w.add_head_count(NQ)
    w.add_head_count_kv(NKV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(512)])
    w.add_token_types([1] * 512)
    w.add_token_merges([])
    w.add_tensor("token_embd.weight", np.zeros((512, H), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_checkpoint(d: Path) -> tuple[int, int]:
    """Shards written tensor by tensor (bf16), so this script itself stays small too."""
    from llama_dflash.formats.safetensors import write_safetensors

    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": H, "num_hidden_layers": L,
           "num_attention_heads": NQ, "num_key_value_heads": NKV, "head_dim": D, "intermediate_size": FF,
           "vocab_size": 512, "block_size": 16, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
           "dflash_config": {"mask_token_id": 3, "target_layer_ids": TAPS}}
    (d / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    shapes = {"fc.weight": (H, H * len(TAPS)), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(L):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "self_attn.q_proj.weight": (NQ * D, H),
                       p + "self_attn.k_proj.weight": (NKV * D, H), p + "self_attn.v_proj.weight": (NKV * D, H),
                       p + "self_attn.o_proj.weight": (H, NQ * D), p + "self_attn.q_norm.weight": (D,),
                       p + "self_attn.k_norm.weight": (D,), p + "post_attention_layernorm.weight": (H,),
                       p + "mlp.gate_proj.weight": (FF, H), p + "mlp.up_proj.weight": (FF, H),
                       p + "mlp.down_proj.weight": (H, FF)})
    weight_map = {}
    total = 0
    largest = 0
    for k, (name, shape) in enumerate(shapes.items()):
        fn = f"model-{k:05d}.safetensors"
        a = rng.standard_normal(shape, dtype=np.float32) * 0.02
        write_safetensors(d / fn, {name: a}, "BF16")
        weight_map[name] = fn
        total += a.size * 2
        largest = max(largest, a.size * 4)
        del a
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total, largest


CONVERT = r"""
import json, sys, time
from llama_dflash.formats import convert_hf_to_gguf
t0 = time.time()
res = convert_hf_to_gguf(sys.argv[1], sys.argv[2], sys.argv[3], outtype="f16")
res["seconds"] = time.time() - t0
# VmHWM: peak of this process image (ru_maxrss would include the parent's pages at fork)
res["peak_rss_bytes"] = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps(res))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/convbench")
    ap.add_argument("--out", default="bench/results/convert.json")
    a = ap.parse_args()
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    make_target(wd / "target.gguf")
    size, largest = make_checkpoint(wd / "hf")
    r = subprocess.run([sys.executable, "-c", CONVERT, str(wd / "hf"), str(wd / "target.gguf"),
                        str(wd / "out.gguf")], capture_output=True, text=True, check=True)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python3"] + sys.argv),
           "checkpoint_bytes_bf16": size, "largest_tensor_bytes_f32": largest,
           "output_bytes_f16": res["bytes"], "peak_rss_bytes": res["peak_rss_bytes"], "seconds": res["seconds"]}
    print(json.dumps(out, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    for f in (wd / "hf").glob("*"):
        f.unlink()
    (wd / "out.gguf").unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CUDA benchmark (issue 21): for a machine with an NVIDIA GPU and the CUDA build
(scripts/setup.sh --cuda; scripts/device-check.sh runs it).

Random-weight targets of Qwen3's shapes, written here with the gguf package (F16, SmolLM2's
tokenizer padded with control tokens to Qwen3's 151,936 ids), and a random DFlash2 drafter of the
published shape (5 layers, block 8, K = 16, selector rank 256) for each:

  1. verify cost t(k) / t(1) for k = 1 ... 16 (the loop verifying k rows, every draft rejected);
  2. the draft step (inject n + 1 feature rows, draft n = 7): ours vs upstream's `dflash` graph on
     the same GGUF and device;
  3. exact mode's self-check on the device: up to how many verify rows the logits are bit-identical
     to one-token decoding (flash attention on, default KV types);
  4. tok/s plain vs speculative at a replayed acceptance of 0.5 / 0.7 / 0.9 (a replay source
     proposes the plain continuation, each token right with that probability; a random drafter
     would accept nothing).  The replay costs nothing, so the drafter's measured step time (part 2)
     is added per step: "speculative" = tokens / (loop time - replay time + steps x draft step).

--smoke: a tiny target and drafter on whatever the build runs on (the CPU here), to check the
script end to end; its numbers mean nothing.

Usage: python3 bench/bench_cuda.py [--targets qwen3-1.7b,qwen3-8b] [--tokens 128] [--smoke]
                                   [--out bench/results/cuda.json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from llama_cpp import _logger

from llama_dflash import SpeculativeGenerator
from llama_dflash.api.models import smollm2_tokenizer
from llama_dflash.core.drafter import Drafter, cuda_devices
from llama_dflash.formats.gguf import DrafterConfig, random_drafter_tensors, write_drafter
from llama_dflash.verify.oracle import ReplayDraftSource
from llama_dflash.verify.upstream import UpstreamDrafter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import step_times  # noqa: E402  (the draft-step timing both benches use)


@dataclass
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    tied: bool
    head_dim: int = 128


SHAPES = {  # Qwen3-1.7B and Qwen3-8B's published shapes
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 6144, 151936, tied=True),
    "qwen3-8b": Shape(4096, 36, 32, 8, 12288, 151936, tied=False),
    "smoke": Shape(512, 6, 8, 2, 1024, 49152, tied=True, head_dim=64),
}
MASK_ID = 16  # SmolLM2's unused '<empty_output>' special token
PROMPT = list(range(1000, 1512))  # 512 prompt positions (ids only: the weights are random)


def write_target(path: Path, s: Shape, seed: int = 0) -> Path:
    """Streams an F16 Qwen3-shaped target to `path`; weights from one random pool (their values do
    not change the speed), norms 1."""
    tok = GGUFReader(smollm2_tokenizer())
    tokens = list(tok.fields["tokenizer.ggml.tokens"].contents())
    types = list(tok.fields["tokenizer.ggml.token_type"].contents())
    merges = list(tok.fields["tokenizer.ggml.merges"].contents())
    tokens += [f"<|extra_{i}|>" for i in range(s.n_vocab - len(tokens))]
    types += [3] * (s.n_vocab - len(types))  # control tokens
    w = GGUFWriter(str(path), "qwen3")
    w.add_name("random-qwen3")
    w.add_block_count(s.n_layer)
    w.add_context_length(8192)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_key_value("tokenizer.chat_template", "{{ messages }}", GGUFValueType.STRING)
    E, hd = s.n_embd, s.head_dim
    shapes = [("token_embd.weight", (s.n_vocab, E)), ("output_norm.weight", (E,))]
    if not s.tied:
        shapes.append(("output.weight", (s.n_vocab, E)))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        shapes += [(p + "attn_norm.weight", (E,)), (p + "attn_q.weight", (s.n_head * hd, E)),
                   (p + "attn_k.weight", (s.n_head_kv * hd, E)), (p + "attn_v.weight", (s.n_head_kv * hd, E)),
                   (p + "attn_output.weight", (E, s.n_head * hd)), (p + "attn_q_norm.weight", (hd,)),
                   (p + "attn_k_norm.weight", (hd,)), (p + "ffn_norm.weight", (E,)),
                   (p + "ffn_gate.weight", (s.n_ff, E)), (p + "ffn_up.weight", (s.n_ff, E)),
                   (p + "ffn_down.weight", (E, s.n_ff))]
    for name, shape in shapes:
        dt = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize,
                          raw_dtype=GGMLQuantizationType.F32 if len(shape) == 1 else GGMLQuantizationType.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    pool = (np.random.default_rng(seed).standard_normal(1 << 22) * 0.02).astype(np.float16)
    for _, shape in shapes:
        n = int(np.prod(shape))
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, np.float32))
        else:
            w.write_tensor_data(np.resize(pool, n).reshape(shape))
    w.close()
    return path


def write_drafter_for(target: Path, s: Shape, path: Path) -> Path:
    taps = sorted({min(x, s.n_layer - 2) for x in (1, s.n_layer // 4, s.n_layer // 2, 3 * s.n_layer // 4, s.n_layer)})
    cfg = DrafterConfig(n_embd=s.n_embd, n_layer=5, n_head=s.n_head, n_head_kv=s.n_head_kv, head_dim=s.head_dim,
                        n_ff=s.n_ff, target_layers=taps, block_size=8, mask_token_id=MASK_ID,
                        rope_theta=1000000.0, rms_eps=1e-6, conv_kernel_size=2, conv_group_size=16,
                        selector_rank=256, selector_top_k=16, n_vocab=s.n_vocab)
    write_drafter(path, cfg, random_drafter_tensors(cfg, seed=3), target, outtype="f16")
    return path


def load_model(path: Path):
    p = llama_cpp.llama_model_default_params()
    p.n_gpu_layers = 999
    m = llama_cpp.llama_model_load_from_file(str(path).encode(), p)
    if not m:
        raise RuntimeError(f"libllama could not load {path}")
    return m


def verify_cost(g: SpeculativeGenerator, plain: list[int]) -> dict:
    per_k = {}
    for k in range(1, 17):
        # the first draft token is always wrong: each step verifies exactly k rows and commits one
        wrong = ReplayDraftSource(PROMPT + plain, g.n_vocab, lambda step, n: 0)
        r = g.generate(PROMPT, 48, draft_len=k - 1, draft_source=wrong if k > 1 else None, stop_on_eos=False)
        per_k[k] = r.stats.t_verify_s / r.stats.steps * 1e3
    return {"t_ms": per_k, "ratio": {k: v / per_k[1] for k, v in per_k.items()}}


def draft_steps(target: Path, drafter: Path, reps: int, n: int = 7) -> dict:
    model = load_model(target)
    ours = Drafter(drafter, model, n_ctx=2048)
    up = UpstreamDrafter(str(drafter), model, n_ctx=2048, exact=False)
    width = len(ours.info.target_layers) * ours.info.n_embd
    feats = np.random.default_rng(0).standard_normal((256 + reps * (n + 1), width)).astype(np.float32)
    ours.push(feats[:256])
    up.push(feats[:256])
    o, u, _ = step_times(ours, up, feats, 256, n, reps, lattice=True, mask_id=MASK_ID)
    walked_on_device = False
    try:
        ours.last_lattice()
    except Exception:  # the scores stayed on the device: the walk ran there
        walked_on_device = True
    ours.close()
    up.close()
    llama_cpp.llama_model_free(model)
    return {"n": n, "ours_ms": o, "upstream_ms": u, "ours_over_upstream": o / u, "walked_on_device": walked_on_device}


def replayed(g: SpeculativeGenerator, plain: list[int], tokens: int, t_draft_ms: float) -> dict:
    base = []
    for _ in range(3):
        base.append(g.generate(PROMPT, tokens, draft_len=0, stop_on_eos=False).stats)
    plain_tps = statistics.median(s.tokens_per_s for s in base)
    out = {"plain_tok_s": plain_tps}
    for alpha in (0.5, 0.7, 0.9):
        for n in (3, 7):
            src = ReplayDraftSource.with_acceptance(PROMPT + plain, g.n_vocab, alpha, seed=1)
            r = g.generate(PROMPT, tokens, draft_len=n, draft_source=src, stop_on_eos=False)
            s = r.stats
            secs = s.t_total_s - s.t_draft_s + s.steps * t_draft_ms / 1e3  # (decode phase, as tokens_per_s)
            tps = (s.n_generated - 1) / secs
            out[f"a{alpha}_n{n}"] = {"tau": s.tau, "steps": s.steps, "tok_s": tps, "vs_plain": tps / plain_tps,
                                     "replay_only_tok_s": s.tokens_per_s, "followed_replay": r.tokens == plain}
    return out


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "none"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="qwen3-1.7b,qwen3-8b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="a tiny target on any build: checks the script only")
    ap.add_argument("--workdir", default=None, help="where the random GGUFs go (default: a temporary folder)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cuda.json"))
    a = ap.parse_args()
    _logger.set_verbose(False)
    llama_cpp.llama_backend_init()
    if not a.smoke and cuda_devices() < 1:
        print("bench_cuda: no CUDA device and CUDA build here (scripts/setup.sh --cuda); --smoke checks the script",
              file=sys.stderr)
        return 2
    names = ["smoke"] if a.smoke else a.targets.split(",")
    res = {"command": " ".join([Path(sys.executable).name] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
           "gpu": gpu_name(), "cuda_devices": cuda_devices(), "cpu": platform.processor() or platform.machine(),
           "smoke": a.smoke, "targets": {}}
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        for name in names:
            s = SHAPES[name]
            t0 = time.perf_counter()
            target = write_target(Path(tmp) / f"{name}.gguf", s)
            drafter = write_drafter_for(target, s, Path(tmp) / f"{name}-dflash2.gguf")
            row: dict = {"shape": s.__dict__, "written_s": time.perf_counter() - t0}
            print(f"{name}: files written in {row['written_s']:.0f} s", flush=True)
            row["draft_step"] = draft_steps(target, drafter, a.reps)
            print(f"{name}: draft step {json.dumps(row['draft_step'])}", flush=True)
            # exact mode's self-check on this device: up to which verify batch the logits are bit-identical
            with SpeculativeGenerator(target, None, n_ctx=2048, n_gpu_layers=999, exact="auto") as g:
                st = g.generate(PROMPT[:16], 2, draft_len=0).stats
                row["exact_self_check"] = st.exact or st.fallback_reason
            print(f"{name}: exact mode: {row['exact_self_check']}", flush=True)
            with SpeculativeGenerator(target, None, n_ctx=2048, n_batch=512, n_gpu_layers=999) as g:
                plain = g.generate(PROMPT, a.tokens, draft_len=0, stop_on_eos=False).tokens
                row["verify_cost"] = verify_cost(g, plain)
                print(f"{name}: t(k)/t(1) " + " ".join(f"{k}:{v:.2f}" for k, v in row["verify_cost"]["ratio"].items()),
                      flush=True)
                row["replayed"] = replayed(g, plain, a.tokens, row["draft_step"]["ours_ms"])
                print(f"{name}: replayed {json.dumps(row['replayed'])}", flush=True)
            res["targets"][name] = row
            os.remove(target)
            os.remove(drafter)
    out = Path(a.out)
    if a.smoke:
        out = out.with_name(out.stem + "_smoke.json") if out.name == "cuda.json" else out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print("saved", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

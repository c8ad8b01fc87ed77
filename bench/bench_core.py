"""Core benchmarks on SmolLM2-135M-Instruct (issue: native core).

Measures, side by side in one run:
  1. target decode tok/s without capture, with layer-input capture, with cb_eval capture;
  2. drafter step time (inject n+1 rows + draft n) for n = 3, 7, 15: ours vs upstream's
     `dflash` graph in libllama on the same GGUF (random weights, 576 hidden, 2 and 5 layers, 5 taps);
     and DFlash2 (convs + selector, K = 16, rank 256) vs DFlash v1 on the same backbone, ours vs upstream;
  3. verify cost t(k)/t(1), k = 1..16 (the loop verifying k rows, all drafts rejected);
  4. the loop's own overhead beyond draft + verify with a replay drafter at fixed acceptance;
  5. (--only reduced_vocab) DFlash2 step time with the full head vs reduced draft vocabularies.

Usage: python bench/bench_core.py [--ftype q4_0] [--tokens 128] [--out bench/results/core.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import _logger

from llama_dflash import SpeculativeGenerator
from llama_dflash.api.models import default_target
from llama_dflash.core.drafter import Drafter
from llama_dflash.formats.gguf import DrafterConfig, random_drafter_tensors, write_drafter
from llama_dflash.verify.oracle import ReplayDraftSource
from llama_dflash.verify.upstream import UpstreamDrafter

PROMPT = ("<|im_start|>user\nExplain how a hash map works and write a small Python implementation."
          "<|im_end|>\n<|im_start|>assistant\n")
TAPS = [1, 8, 14, 20, 27]


def drafter_gguf(target: Path, n_layer: int, out_dir: Path, v2: bool = False) -> Path:
    """Random drafter of SmolLM2's shape; v2 adds DFlash2 convs + selector to the same backbone."""
    cfg = DrafterConfig(n_embd=576, n_layer=n_layer, n_head=9, n_head_kv=3, head_dim=64, n_ff=1536,
                        target_layers=TAPS, block_size=16, mask_token_id=16, rope_theta=100000.0,
                        rms_eps=1e-5)
    if v2:
        cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k = 2, 16, 256, 16
        cfg.n_vocab = 49152
    p = out_dir / f"drafter-{n_layer}l{'-v2' if v2 else ''}.gguf"
    t = random_drafter_tensors(cfg, seed=n_layer)  # the backbone draws come first: same weights for v1 and v2
    write_drafter(p, cfg, t, target, outtype="f16")
    return p


def decode_speed(target: Path, tokens: int, threads: int, rounds: int = 6) -> dict:
    """Plain decode tok/s; the three configurations run interleaved so drift hits all alike."""
    cfgs = {"no_capture": {}, "layer_inp": {"capture_layers": TAPS, "capture": "layer_inp"},
            "cb_eval": {"capture_layers": TAPS, "capture": "cb_eval"}}
    gens = {k: SpeculativeGenerator(target, n_ctx=1024, n_threads=threads, **kw) for k, kw in cfgs.items()}
    toks = gens["no_capture"].tokenize(PROMPT)
    runs: dict[str, list[float]] = {k: [] for k in cfgs}
    for g in gens.values():
        g.generate(toks, 8)
    keys = list(gens)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotate the order: no position bias
            runs[k].append(gens[k].generate(toks, tokens, stop_on_eos=False).stats.tokens_per_s)
    for g in gens.values():
        g.close()
    return {k: statistics.median(v) for k, v in runs.items()}


def step_times(ours: Drafter, up: UpstreamDrafter, feats: np.ndarray, pos: int, n: int, reps: int,
               lattice: bool = False, mask_id: int = 16) -> tuple[float, float, int]:
    """Median ms of one drafter step (inject n + 1 feature rows from feats[pos:], draft n), ours and
    upstream's in turn; lattice: upstream's DFlash2 read-out.  Returns (ours, upstream, next pos)."""
    t_ours, t_up = [], []
    for _ in range(reps):
        rows = feats[pos:pos + n + 1]
        t0 = time.perf_counter()
        ours.push(rows)
        ours.draft(100, n)
        t1 = time.perf_counter()
        up.push(rows)
        if lattice:
            up.lattice(100, mask_id, n)
        else:
            up.draft(100, mask_id, n, return_logits=False)
        t_ours.append(t1 - t0)
        t_up.append(time.perf_counter() - t1)
        pos += n + 1
    return statistics.median(t_ours) * 1e3, statistics.median(t_up) * 1e3, pos


def drafter_steps(target: Path, tmp: Path, threads: int, reps: int) -> dict:
    model = llama_cpp.llama_model_load_from_file(str(target).encode(), llama_cpp.llama_model_default_params())
    res = {}
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((4096, len(TAPS) * 576)).astype(np.float32)
    for n_layer in (2, 5):
        path = drafter_gguf(target, n_layer, tmp)
        ours = Drafter(path, model, n_ctx=2048, n_threads=threads)
        up = UpstreamDrafter(str(path), model, n_ctx=2048, n_threads=threads, exact=False)
        ours.push(feats[:256])
        up.push(feats[:256])
        pos = 256
        for n in (3, 7, 15):
            o, u, pos = step_times(ours, up, feats, pos, n, reps)
            res[f"{n_layer}l_n{n}"] = {"ours_ms": o, "upstream_ms": u, "ours_over_upstream": o / u}
        ours.close()
        up.close()
    llama_cpp.llama_model_free(model)
    return res


def dflash2_steps(target: Path, tmp: Path, threads: int, reps: int) -> dict:
    """DFlash2 vs DFlash v1 on the same 2-layer backbone (ours), and ours vs upstream's DFlash2 graph."""
    model = llama_cpp.llama_model_load_from_file(str(target).encode(), llama_cpp.llama_model_default_params())
    rng = np.random.default_rng(1)
    feats = rng.standard_normal((4096, len(TAPS) * 576)).astype(np.float32)
    p1, p2 = drafter_gguf(target, 2, tmp), drafter_gguf(target, 2, tmp, v2=True)
    v1 = Drafter(p1, model, n_ctx=2048, n_threads=threads)
    v2 = Drafter(p2, model, n_ctx=2048, n_threads=threads)
    up = UpstreamDrafter(str(p2), model, n_ctx=2048, n_threads=threads, exact=False)
    for d in (v1, v2, up):
        d.push(feats[:256])
    res = {}
    pos = 256
    for n in (3, 7, 15):
        t = {"v1": [], "v2": [], "up": []}
        for _ in range(reps):
            rows = feats[pos:pos + n + 1]
            for name, d in (("v1", v1), ("v2", v2)):
                t0 = time.perf_counter()
                d.push(rows)
                d.draft(100, n)
                t[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            up.push(rows)
            up.lattice(100, 16, n)
            t["up"].append(time.perf_counter() - t0)
            pos += n + 1
        m = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        res[f"n{n}"] = {"v1_ms": m["v1"], "v2_ms": m["v2"], "upstream_v2_ms": m["up"],
                        "v2_over_v1": m["v2"] / m["v1"], "ours_over_upstream": m["v2"] / m["up"]}
    for d in (v1, v2, up):
        d.close()
    llama_cpp.llama_model_free(model)
    return res


def reduced_vocab_steps(target: Path, tmp: Path, threads: int, reps: int) -> dict:
    """DFlash2 (2 layers) with the target's whole 49152-token head vs reduced draft vocabularies
    (d2t + own head rows, copied from the target's head), ours vs upstream on the same files."""
    from llama_dflash.formats.vocab import reduce_vocab

    model = llama_cpp.llama_model_load_from_file(str(target).encode(), llama_cpp.llama_model_default_params())
    rng = np.random.default_rng(2)
    feats = rng.standard_normal((4096, len(TAPS) * 576)).astype(np.float32)
    full = drafter_gguf(target, 2, tmp, v2=True)
    paths = {"49152": full}
    for size in (16384, 8192, 4096):  # which ids are kept does not change the cost
        paths[str(size)] = reduce_vocab(full, target, tmp / f"v2-{size}.gguf", np.arange(size))
    ds = {k: (Drafter(p, model, n_ctx=2048, n_threads=threads),
              UpstreamDrafter(str(p), model, n_ctx=2048, n_threads=threads, exact=False)) for k, p in paths.items()}
    for d, u in ds.values():
        d.push(feats[:256])
        u.push(feats[:256])
    res = {}
    pos = 256
    for n in (3, 7):
        t = {k: ([], []) for k in ds}
        for _ in range(reps):
            rows = feats[pos:pos + n + 1]
            for k, (d, u) in ds.items():  # every size in turn: drift hits all alike
                t0 = time.perf_counter()
                d.push(rows)
                d.draft(100, n)
                t1 = time.perf_counter()
                u.push(rows)
                u.lattice(100, 16, n)
                t[k][0].append(t1 - t0)
                t[k][1].append(time.perf_counter() - t1)
            pos += n + 1
        for k, (o, u) in t.items():
            mo, mu = statistics.median(o) * 1e3, statistics.median(u) * 1e3
            res[f"v{k}_n{n}"] = {"draft_vocab": int(k), "n": n, "ours_ms": mo, "upstream_ms": mu,
                                 "ours_over_upstream": mo / mu}
    for d, u in ds.values():
        d.close()
        u.close()
    llama_cpp.llama_model_free(model)
    return res


def inloop_steps(target: Path, tmp: Path, threads: int, reps: int, contexts: tuple[int, ...] = (256,)) -> dict:
    """A drafter step in the loop's shape, ours and upstream's graph on the same file: a target
    verify of n + 1 rows (which streams the target's weights through the caches, as in the loop),
    then one feature row injected and a draft of n, after `context` rows already in the drafter's
    cache (a longer prompt: more keys to attend to).  Files: a random DFlash v1 drafter with the
    target's full head (2 layers, f16) and the shipped drafter."""
    from llama_dflash.api.models import shipped_drafter

    llm = llama_cpp.Llama(str(target), n_ctx=4096, n_threads=threads, verbose=False)
    rng = np.random.default_rng(3)
    ctx_max = max(contexts) + reps + 64
    feats = rng.standard_normal((ctx_max, len(TAPS) * 576)).astype(np.float32)
    files = {"v1_2l_full_vocab": (drafter_gguf(target, 2, tmp), False), "shipped": (shipped_drafter(), True)}
    res = {}
    for name, (path, lattice) in files.items():
        ours = Drafter(path, llm.model, n_ctx=ctx_max, n_threads=threads)
        up = UpstreamDrafter(str(path), llm.model, n_ctx=ctx_max, n_threads=threads, exact=False)
        for n, ctx in ((n, c) for c in contexts for n in (3, 7)):
            ours.reset()
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(up.ctx), True)
            up.n_past = 0
            ours.push(feats[:ctx])
            up.push(feats[:ctx])
            t = {"ours": [], "upstream": []}
            for i in range(reps):
                row = feats[ctx + i:ctx + i + 1]
                for who in ("ours", "upstream"):
                    if llm.n_tokens + n + 1 > 4000:
                        llm.reset()
                    llm.eval([100 + (i + k) % 50 for k in range(n + 1)])  # the verify before the draft
                    t0 = time.perf_counter()
                    if who == "ours":
                        ours.push(row)
                        ours.draft(100, n)
                    else:
                        up.push(row)
                        if lattice:
                            up.lattice(100, 16, n)
                        else:
                            up.draft(100, 16, n, return_logits=False)
                    t[who].append(time.perf_counter() - t0)
            o, u = statistics.median(t["ours"]) * 1e3, statistics.median(t["upstream"]) * 1e3
            key = f"{name}_n{n}" + (f"_ctx{ctx}" if contexts != (256,) else "")
            res[key] = {"ours_ms": o, "upstream_ms": u, "ours_over_upstream": o / u}
        ours.close()
        up.close()
    return res


def verify_cost(target: Path, threads: int) -> dict:
    with SpeculativeGenerator(target, n_ctx=2048, n_threads=threads) as g:
        toks = g.tokenize(PROMPT)
        plain = g.generate(toks, 64, stop_on_eos=False)
        per_k = {}
        for k in range(1, 17):
            # the first draft is always wrong: each step verifies exactly k rows and commits one token
            wrong = ReplayDraftSource(toks + plain.tokens, g.n_vocab, lambda step, n: 0)
            r = g.generate(toks, 48, draft_len=k - 1, draft_source=wrong if k > 1 else None, stop_on_eos=False)
            per_k[k] = r.stats.t_verify_s / r.stats.steps * 1e3
    return {"t_ms": per_k, "ratio": {k: v / per_k[1] for k, v in per_k.items()}}


def replay_sequence(g: SpeculativeGenerator, toks: list[int], tokens: int, n: int, alpha: float) -> list[int]:
    """A continuation the replay drafter can follow to the end.

    Batched verification and single-token decoding can pick different tokens at
    numerical near-ties; replaying the plain output would then turn every later
    draft into a rejection.  Iterate: replay the speculative output until it
    reproduces itself.
    """
    seq = g.generate(toks, tokens, stop_on_eos=False).tokens
    for _ in range(6):
        src = ReplayDraftSource.with_acceptance(toks + seq, g.n_vocab, alpha, seed=1)
        out = g.generate(toks, tokens, draft_len=n, draft_source=src, stop_on_eos=False).tokens
        if out == seq:
            break
        seq = out
    return seq


def loop_overhead(target: Path, threads: int, tokens: int) -> dict:
    out = {}
    with SpeculativeGenerator(target, n_ctx=2048, n_threads=threads) as g:
        toks = g.tokenize(PROMPT)
        for n, alpha in [(3, 0.8), (7, 0.8), (7, 0.5)]:
            seq = replay_sequence(g, toks, tokens, n, alpha)
            src = ReplayDraftSource.with_acceptance(toks + seq, g.n_vocab, alpha, seed=1)
            r = g.generate(toks, tokens, draft_len=n, draft_source=src, stop_on_eos=False)
            s = r.stats
            out[f"n{n}_a{alpha}"] = {"tau": s.tau, "steps": s.steps, "t_draft_s": s.t_draft_s,
                                     "t_verify_s": s.t_verify_s, "t_other_s": s.t_other_s,
                                     "overhead_frac": s.t_other_s / (s.t_draft_s + s.t_verify_s),
                                     "followed_replay": r.tokens == seq}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ftype", default="q4_0", choices=["q4_0", "q8_0"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/core.json")
    ap.add_argument("--only", choices=["reduced_vocab", "inloop"], default=None,
                    help="run one part and merge it into --out (its command and date recorded with it)")
    ap.add_argument("--contexts", default="256",
                    help="with --only inloop: rows in the drafter's cache before the timed steps, comma-separated")
    a = ap.parse_args()
    _logger.set_verbose(False)
    target = default_target(a.ftype)
    command = " ".join([Path(sys.executable).name] + sys.argv)
    if a.only:
        res = json.loads(Path(a.out).read_text()) if Path(a.out).is_file() else {}
        with tempfile.TemporaryDirectory() as tmp:
            if a.only == "reduced_vocab":
                steps = reduced_vocab_steps(target, Path(tmp), a.threads, a.reps)
            else:
                try:
                    contexts = tuple(int(c) for c in a.contexts.split(","))
                except ValueError:
                    contexts = ()
                if not contexts or min(contexts) < 1 or max(contexts) > 32768:
                    ap.error(f"--contexts takes comma-separated row counts of 1 .. 32768, not {a.contexts!r}")
                steps = inloop_steps(target, Path(tmp), a.threads, a.reps, contexts)
            res[a.only] = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M"), "target_ftype": a.ftype,
                           "steps": steps}
        for k, v in res[a.only]["steps"].items():
            print(f"{k}: ours {v['ours_ms']:.2f} ms, upstream {v['upstream_ms']:.2f} ms "
                  f"({v['ours_over_upstream']:.2f}x)")
        Path(a.out).write_text(json.dumps(res, indent=1))
        print("saved", a.out)
        return 0
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
           "threads": a.threads, "target": f"SmolLM2-135M-Instruct {a.ftype.upper()}", "command": command}
    with tempfile.TemporaryDirectory() as tmp:
        res["decode_tok_s"] = decode_speed(target, a.tokens, a.threads)
        print("decode tok/s:", json.dumps(res["decode_tok_s"]))
        res["drafter_step"] = drafter_steps(target, Path(tmp), a.threads, a.reps)
        for k, v in res["drafter_step"].items():
            print(f"drafter {k}: ours {v['ours_ms']:.2f} ms, upstream {v['upstream_ms']:.2f} ms "
                  f"({v['ours_over_upstream']:.2f}x)")
        res["dflash2_step"] = dflash2_steps(target, Path(tmp), a.threads, a.reps)
        for k, v in res["dflash2_step"].items():
            print(f"dflash2 {k}: v1 {v['v1_ms']:.2f} ms, v2 {v['v2_ms']:.2f} ms ({v['v2_over_v1']:.2f}x), "
                  f"upstream v2 {v['upstream_v2_ms']:.2f} ms (ours {v['ours_over_upstream']:.2f}x)")
        res["verify"] = verify_cost(target, a.threads)
        print("verify t(k)/t(1):", " ".join(f"{k}:{v:.2f}" for k, v in res["verify"]["ratio"].items()))
        res["loop_overhead"] = loop_overhead(target, a.threads, a.tokens)
        for k, v in res["loop_overhead"].items():
            print(f"loop {k}: tau {v['tau']:.2f}, overhead {100 * v['overhead_frac']:.2f}% "
                  f"of draft+verify, replay followed {v['followed_replay']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("saved", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

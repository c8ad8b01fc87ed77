"""The shipped drafter on HumanEval prompts (held out of its training data).

Side by side in one run, prompt by prompt (so machine noise hits every configuration alike):
  - plain llama-cpp-python (llama_cpp.Llama.generate), greedy and T = 0.7;
  - our loop, greedy, n = 3 / 5 / 7 drafted tokens: tau, per-position acceptance, decode tok/s,
    and whether the output equals llama-cpp-python's (a divergence is classified by its
    top-1/top-2 margin: near-tie or mismatch);
  - our loop at T = 0.7 (top-k 40, top-p 0.95, min-p 0.05), match and rejection verification.
Decode tok/s excludes prefill in every configuration.  --format chat (default): each problem as a
chat turn ("Complete the following Python function." and the code, in the chat template); raw: the
problem's own prompt (signature and docstring) as a raw completion prefix, tokenized as
create_completion tokenizes it -- how code-completion users call the model.

Usage: python bench/bench_humaneval.py [--problems 40] [--tokens 128] [--drafter D.gguf] [--format chat|raw]
                                       [--out bench/results/humaneval.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import llama_cpp
from llama_cpp import _logger

from llama_dflash import SamplingParams, SpeculativeGenerator
from llama_dflash.api.models import default_target, shipped_drafter
from llama_dflash.core import kernels
from llama_dflash.train.prompts import chatml, humaneval_problems, humaneval_prompts
from llama_dflash.verify.certify import certify, divergence_report
from llama_dflash.verify.certify import checker as make_checker

SAMPLING = dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05)


def plain_llama_cpp(llm: llama_cpp.Llama, toks: list[int], n: int, temperature: float, seed: int,
                    our_kernels: bool = False) -> tuple[list[int], float]:
    """llama-cpp-python's own decoding: (tokens, decode seconds after the first token).  Importing
    llama-dflash registers our small-batch kernels for every context, so they are switched off for
    it (as it runs without llama-dflash) unless `our_kernels`."""
    llm.reset()
    llm.set_seed(seed)
    out, t1 = [], None
    kw = dict(temp=temperature, top_k=SAMPLING["top_k"], top_p=SAMPLING["top_p"], min_p=SAMPLING["min_p"]) \
        if temperature > 0 else dict(temp=0.0)
    kernels.set_enabled(our_kernels)
    try:
        for t in llm.generate(toks, reset=True, **kw):
            if t1 is None:
                t1 = time.perf_counter()
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t):
                break
            out.append(t)
            if len(out) >= n:
                break
    finally:
        kernels.set_enabled(True)
    return out, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=40, help="the first N HumanEval problems (164 = all)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drafter", default=None, help="default: the shipped drafter")
    ap.add_argument("--draft-lens", default="3,5,7")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--format", choices=["chat", "raw"], default="chat")
    ap.add_argument("--out", default="bench/results/humaneval.json")
    a = ap.parse_args()
    _logger.set_verbose(False)
    target = default_target()
    drafter = a.drafter or shipped_drafter()
    if drafter is None:
        sys.exit("no drafter: pass --drafter or install a build that ships one")
    ns = [int(x) for x in a.draft_lens.split(",")]
    threads = a.threads or len(os.sched_getaffinity(0))
    probs = humaneval_prompts()[: a.problems]
    raw = [p["prompt"] for p in humaneval_problems()[: a.problems]]  # (the same problems, in order)
    llm = llama_cpp.Llama(str(target), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    g = SpeculativeGenerator(target, drafter, n_ctx=1024, n_threads=threads)
    # plain llama-cpp-python keeping every row's logits: replays a divergent run's verify batches
    checker = make_checker(str(target), 1024, threads)
    agg: dict[str, dict] = {}

    def add(key: str, n_tok: int, secs: float, stats=None) -> None:
        d = agg.setdefault(key, {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "steps": 0,
                                 "pos_drafted": [], "pos_accepted": [], "t_draft": 0.0, "t_verify": 0.0})
        d["tokens"] += n_tok
        d["seconds"] += secs
        if stats is not None:
            d["t_draft"] += stats.t_draft_s
            d["t_verify"] += stats.t_verify_s
            d["drafted"] += stats.drafted
            d["accepted"] += stats.accepted
            d["steps"] += stats.steps
            for k, (dr, ac) in enumerate(zip(stats.per_position_drafted, stats.per_position_accepted, strict=True)):
                if k >= len(d["pos_drafted"]):
                    d["pos_drafted"].append(0)
                    d["pos_accepted"].append(0)
                d["pos_drafted"][k] += dr
                d["pos_accepted"][k] += ac

    identical = {n: 0 for n in ns}
    divergences = []
    g.generate(g.tokenize(chatml("Hi")), 4, draft_len=0)  # warm-up
    t_start = time.time()
    for i, p in enumerate(probs):
        # raw: as llama-cpp-python 0.3.36's create_completion tokenizes a prompt string (BOS where the
        # vocabulary adds one, special tokens parsed)
        toks = g.tokenize(raw[i], add_special=True, parse_special=True) if a.format == "raw" \
            else g.tokenize(chatml(p.text))
        ref, secs = plain_llama_cpp(llm, toks, a.tokens, 0.0, 0)
        add("llama_cpp_greedy", max(0, len(ref) - 1), secs)
        r = g.generate(toks, a.tokens, draft_len=0)
        add("ours_plain_greedy", max(0, r.stats.n_generated - 1), r.stats.t_total_s, r.stats)
        pm = None  # the plain run with logit margins, computed once if some n diverges
        for n in ns:
            r = g.generate(toks, a.tokens, draft_len=n)
            add(f"greedy_n{n}", max(0, r.stats.n_generated - 1), r.stats.t_total_s, r.stats)
            if r.tokens[: len(ref)] == ref or ref[: len(r.tokens)] == r.tokens:
                identical[n] += 1
            else:
                if pm is None:
                    pm = g.generate(toks, a.tokens, draft_len=0, return_margins=True)
                steps: list[dict] = []
                sm = g.generate(toks, a.tokens, draft_len=n, return_margins=True, on_step=steps.append)
                replay = certify(checker, toks + pm.tokens, toks + sm.tokens, len(toks), steps)
                rep = divergence_report(g, pm, sm, 0.1, replay=replay)
                divergences.append({"problem": p.key, "n": n, **{k: rep.get(k) for k in
                                    ("identical", "position", "plain_margin", "spec_margin", "verdict", "replay")}})
        ref_s, secs = plain_llama_cpp(llm, toks, a.tokens, SAMPLING["temperature"], 1000 + i)
        add("llama_cpp_t0.7", max(0, len(ref_s) - 1), secs)
        for mode in ("match", "rejection"):
            for n in ns:
                r = g.generate(toks, a.tokens, draft_len=n, sampling=SamplingParams(seed=1000 + i, mode=mode,
                                                                                     **SAMPLING))
                add(f"t0.7_{mode}_n{n}", max(0, r.stats.n_generated - 1), r.stats.t_total_s, r.stats)
        print(f"[{i + 1}/{len(probs)}] {time.time() - t_start:.0f} s", file=sys.stderr, flush=True)
    g.close()
    checker.close()

    base = {"greedy": agg["llama_cpp_greedy"], "t0.7": agg["llama_cpp_t0.7"]}
    rows = {}
    for k, d in agg.items():
        tps = d["tokens"] / d["seconds"] if d["seconds"] else 0.0
        row = {"tok_s": round(tps, 1)}
        if d["steps"]:
            # per verify step: drafting and verification milliseconds (where the time goes)
            row.update(draft_ms_per_step=round(1e3 * d["t_draft"] / d["steps"], 2),
                       verify_ms_per_step=round(1e3 * d["t_verify"] / d["steps"], 2))
        if d["drafted"]:
            row.update(tau=round(1 + d["accepted"] / d["steps"], 3),
                       acceptance_rate=round(d["accepted"] / max(1, d["drafted"]), 3),
                       per_position=[round(ac / dr, 3) if dr else None
                                     for dr, ac in zip(d["pos_drafted"], d["pos_accepted"], strict=True)])
        b = base["t0.7" if k.startswith(("t0.7", "llama_cpp_t0.7")) else "greedy"]
        row["speedup_vs_llama_cpp"] = round(tps / (b["tokens"] / b["seconds"]), 3)
        rows[k] = row
    result = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": f"{platform.processor() or platform.machine()}, {threads} threads",
              "target": str(target), "drafter": str(drafter), "problems": len(probs), "max_tokens": a.tokens,
              "format": a.format,
              "sampling": SAMPLING, "results": rows,
              "greedy_identical_to_llama_cpp": {f"n{n}": f"{identical[n]}/{len(probs)}" for n in ns},
              "divergences": divergences, "wall_s": round(time.time() - t_start, 1)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{'configuration':24s} {'tok/s':>7s} {'vs llama.cpp':>12s} {'tau':>6s} {'draft/verify ms':>16s}  "
          "per-position acceptance")
    for k, r in rows.items():
        pp = " ".join(f"{x:.2f}" for x in r.get("per_position", []) if x is not None)
        ms = f"{r['draft_ms_per_step']:.1f} / {r['verify_ms_per_step']:.1f}" if "verify_ms_per_step" in r else ""
        print(f"{k:24s} {r['tok_s']:7.1f} {r['speedup_vs_llama_cpp']:11.2f}x {r.get('tau', 1.0):6.2f} {ms:>16s}  {pp}")
    print("greedy identical to llama-cpp-python:", result["greedy_identical_to_llama_cpp"],
          "divergences:", [(d["problem"], d["n"], d["verdict"]) for d in divergences])
    print(f"totals over {len(probs)} problems; wall {result['wall_s']} s -> {a.out}")


if __name__ == "__main__":
    main()

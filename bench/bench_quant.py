"""One drafter in several weight types (`llama-dflash quantize`), side by side in the loop.

For each type the drafter's matrices are re-encoded (norms, conv bases, codebooks stay f32) and
every configuration runs on each HumanEval prompt in turn (chat template, greedy): fixed draft
lengths and the adaptive default.  Reported per type: τ, acceptance per position, draft and
verify ms per step, decode tok/s against our plain loop in the same run.

The shipped drafter's q8_0 original (before it was requantized to q4_0) is in git history:

    git show b306122:python/llama_dflash/data/smollm2-135m-dflash.gguf > /tmp/q8.gguf
    python3 bench/bench_quant.py --drafter /tmp/q8.gguf --types q8_0,q4_0

Usage: python bench/bench_quant.py [--drafter PATH] [--types q8_0,q4_0] [--problems 20]
                                   [--tokens 128] [--fixed 3,7] [--out bench/results/quant.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from llama_cpp import _logger

from llama_dflash import SpeculativeGenerator
from llama_dflash.api.models import default_target, shipped_drafter
from llama_dflash.formats.gguf import OUTTYPES, quantize_drafter
from llama_dflash.train.prompts import humaneval_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=None, help="default: the shipped drafter")
    ap.add_argument("--types", default="q8_0,q4_0")
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--fixed", default="3,7")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", default="bench/results/quant.json")
    a = ap.parse_args()
    types = a.types.split(",")
    if not types or any(t not in OUTTYPES for t in types):
        ap.error(f"--types: each of {', '.join(OUTTYPES)}")
    fixed = [int(x) for x in a.fixed.split(",") if x]
    _logger.set_verbose(False)
    src = Path(a.drafter) if a.drafter else shipped_drafter()
    target = default_target()
    prompts = [p.render() for p in humaneval_prompts()[: a.problems]]
    t_start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        files = {t: quantize_drafter(src, Path(tmp) / f"{t}.gguf", t) for t in types}
        gens = {t: SpeculativeGenerator(target, f["path"], n_ctx=2048, n_threads=a.threads) for t, f in files.items()}
        configs = [("plain", 0)] + [(f"n={n}", n) for n in fixed] + [("adaptive", None)]
        acc: dict[str, dict] = {}
        for i, p in enumerate(prompts):
            for name, n in configs:
                for t, g in gens.items():
                    if name == "plain" and t != types[0]:
                        continue  # one plain loop (the drafter is not called)
                    kw = {"speculation": "auto"} if n is None else {"draft_len": n}
                    s = g.generate(g.tokenize(p), a.tokens, **kw).stats
                    key = "plain" if name == "plain" else f"{t} {name}"
                    r = acc.setdefault(key, {"tokens": 0, "steps": 0, "decode_s": 0.0, "draft_s": 0.0,
                                             "verify_s": 0.0, "drafted": [], "accepted": []})
                    r["tokens"] += s.n_generated - 1
                    r["steps"] += s.steps
                    r["decode_s"] += s.t_total_s
                    r["draft_s"] += s.t_draft_s
                    r["verify_s"] += s.t_verify_s
                    for k, (dr, ac) in enumerate(zip(s.per_position_drafted, s.per_position_accepted, strict=True)):
                        if k == len(r["drafted"]):
                            r["drafted"].append(0)
                            r["accepted"].append(0)
                        r["drafted"][k] += dr
                        r["accepted"][k] += ac
            print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr)
        for g in gens.values():
            g.close()
        sizes = {t: f["bytes"] for t, f in files.items()}
    plain_tps = acc["plain"]["tokens"] / acc["plain"]["decode_s"]
    rows = {}
    for key, r in acc.items():
        tps = r["tokens"] / r["decode_s"]
        rows[key] = {"tok_s": round(tps, 2), "vs_plain": round(tps / plain_tps, 3),
                     "tau": round(r["tokens"] / r["steps"], 3),
                     "draft_ms_per_step": round(r["draft_s"] / r["steps"] * 1e3, 2),
                     "verify_ms_per_step": round(r["verify_s"] / r["steps"] * 1e3, 2),
                     "acceptance": [round(ac / dr, 3)
                                    for dr, ac in zip(r["drafted"], r["accepted"], strict=True) if dr]}
        print(f"{key:16s} {tps:6.1f} tok/s  x{tps / plain_tps:.3f}  tau {rows[key]['tau']:.3f}  "
              f"draft {rows[key]['draft_ms_per_step']:.2f} ms  verify {rows[key]['verify_ms_per_step']:.2f} ms")
    res = {"command": " ".join([Path(sys.executable).name] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
           "threads": a.threads, "target": Path(target).name, "drafter": str(src), "problems": a.problems,
           "tokens": a.tokens, "bytes": sizes, "results": rows, "wall_s": round(time.time() - t_start)}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

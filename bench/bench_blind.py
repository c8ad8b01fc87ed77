"""Draft sources without confidences ("blind": a `draft_source=` callable), replayed: how the
engine's policy (csrc/dflash_policy.c) does against plain decoding and against the best fixed
draft length, on the verify costs this machine measured.

A source at i.i.d. acceptance p (each slot right with probability p while the ones before it were)
is replayed with `core.policy.replay` -- the engine's own plan / cut / learn steps, each step timed
on the given cost curve: no model runs, so the figures are deterministic for a given curve.  The
curves are measured ones, read from other results: the Qwen2.5-Coder-1.5B and Gemma-3-270M verify
costs of `bench_adaptive.py --parts replay` (adaptive.json) and SmolLM2-135M's of
`bench_policy.py` (policy.json).  Five cases per curve:

  - warm: `--gens` generations of `--tokens` tokens one after the other, replayed twice and the
    second pass reported (the policy carries what it learnt from one text into the next as a
    prior), mean and worst over `--seeds`;
  - cold: a fresh engine, two generations (what bench_adaptive's replay part measures);
  - turns good: 4 generations at p = 0.3, then 4 at p = 0.9; the speed over the second half;
  - turns bad: the other way round;
  - mixed: 12 generations, each at its own p (MIXED), from a fresh engine; against the best fixed
    length of each generation.

Each against the best fixed draft length for the same traces (which the policy does not know).

Usage: python3 bench/bench_blind.py [--seeds 4] [--gens 8] [--tokens 128] [--out bench/results/blind.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from llama_dflash.core import policy

HERE = Path(__file__).resolve().parent
PS = (0.0, 0.3, 0.5, 0.7, 0.9)
MIXED = (0.9, 0.3, 0.7, 0.0, 0.5, 0.9, 0.3, 0.9, 0.0, 0.7, 0.3, 0.5)  # one acceptance per generation


def best_fixed(traces, tv: list[float], n_max: int) -> float:
    plain = sum(map(len, traces)) * tv[0]
    return max(1.0, max(plain / policy.fixed_seconds(traces, tv, n) for n in range(1, n_max + 1)))


def curves(extra: list[str]) -> dict[str, list[float]]:
    """Measured verify costs (seconds for 1 .. n_max + 1 rows) from the other benches' results, and
    any given as LABEL=ms,ms,... (e.g. an earlier hour's, from a results file's history)."""
    out = {}
    for x in extra:
        label, _, ms = x.partition("=")
        out[label] = [float(v) / 1e3 for v in ms.split(",")]
    ad = HERE / "results" / "adaptive.json"
    if ad.is_file():
        r = json.loads(ad.read_text()).get("replay", {})
        for label, rows in r.get("targets", {}).items():
            out[f"{label} ({r['date'][:16]})"] = [x / 1e3 for x in rows["cost_model_ms"]["t_verify"]]
    po = HERE / "results" / "policy.json"
    if po.is_file():
        r = json.loads(po.read_text())
        out[f"{r['target']} ({r['date'][:16]})"] = [x / 1e3 for x in r["cost_model_ms"]["t_verify"]]
    if not out:
        sys.exit("bench_blind: needs bench/results/adaptive.json (replay part) or policy.json for measured costs")
    return out


def _switch(p0: float, p1: float, tv: list[float], seeds: int, tokens: int, n_max: int) -> dict:
    """4 generations at acceptance p0, then 4 at p1: the speed over the second half against plain."""
    xs, bests = [], []
    for seed in range(seeds):
        first = policy.iid_traces(p0, 4, tokens, seed, n_max)
        then = policy.iid_traces(p1, 4, tokens, seed + 100, n_max)
        both, before = (policy.replay(t, tv, [], n_max, passes=1)["seconds"] for t in (first + then, first))
        xs.append(sum(map(len, then)) * tv[0] / (both - before))
        bests.append(best_fixed(then, tv, n_max))
    return {"mean": round(sum(xs) / seeds, 3), "min": round(min(xs), 3), "best_fixed": round(sum(bests) / seeds, 3)}


def run_curve(tv: list[float], seeds: int, gens: int, tokens: int) -> dict:
    n_max = min(len(tv) - 1, 15)
    res: dict = {"t_verify_ms": [round(x * 1e3, 2) for x in tv], "n_max": n_max, "p": {}}
    for p in PS:
        warm, cold, best = [], [], []
        for seed in range(seeds):
            tr = policy.iid_traces(p, gens, tokens, seed, n_max)
            r = policy.replay(tr, tv, [], n_max)
            warm.append(r["plain_seconds"] / r["seconds"])
            best.append(best_fixed(tr, tv, n_max))
            r = policy.replay(tr[:2], tv, [], n_max, passes=1)
            cold.append(r["plain_seconds"] / r["seconds"])
        res["p"][str(p)] = {"warm_mean": round(sum(warm) / seeds, 3), "warm_min": round(min(warm), 3),
                            "cold_mean": round(sum(cold) / seeds, 3), "cold_min": round(min(cold), 3),
                            "best_fixed": round(sum(best) / seeds, 3)}
    res["turns_good"] = _switch(0.3, 0.9, tv, seeds, tokens, n_max)
    res["turns_bad"] = _switch(0.9, 0.3, tv, seeds, tokens, n_max)
    xs, bests = [], []
    for seed in range(seeds):  # each generation another source quality (prompts that quote what follows, or not)
        trs = [policy.iid_traces(p, 1, tokens, seed * 100 + i, n_max)[0] for i, p in enumerate(MIXED)]
        r = policy.replay(trs, tv, [], n_max, passes=1)
        xs.append(r["plain_seconds"] / r["seconds"])
        bests.append(r["plain_seconds"] / sum(len(t) * tv[0] / best_fixed([t], tv, n_max) for t in trs))
    res["mixed"] = {"mean": round(sum(xs) / seeds, 3), "min": round(min(xs), 3),
                    "best_fixed_each": round(sum(bests) / seeds, 3)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--gens", type=int, default=8, help="generations one after the other (warm)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--curve", action="append", default=[], metavar="LABEL=MS,MS,...",
                    help="another verify-cost curve (ms for 1 .. n rows), e.g. an earlier hour's")
    ap.add_argument("--out", default=str(HERE / "results" / "blind.json"))
    a = ap.parse_args()
    out = {"command": "python3 bench/bench_blind.py" + "".join(f" {x}" for x in sys.argv[1:]),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "seeds": a.seeds, "gens": a.gens,
           "tokens": a.tokens, "curves": {}}
    for label, tv in curves(a.curve).items():
        out["curves"][label] = r = run_curve(tv, a.seeds, a.gens, a.tokens)
        print(label, json.dumps(r), flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

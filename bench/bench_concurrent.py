"""Concurrent requests: served in turn, or together with their steps sharing one decode (issue: robustness / load).

A server with several requests in flight either queues them (one generation at a time: what
``parallel=1`` does, and what the server did before) or serves them together
(``Llama(parallel=P)``: up to P at once, one ``llama_decode`` verifying every active sequence's
draft; core/group.py).  Here 8 client threads send 16 distinct greedy requests of --tokens each
to one model, from two sets: "short" (one-line prompts: decode-bound) and "chat" (HumanEval
problems and prose questions in SmolLM2's chat template: 60-250 prompt tokens, whose prefill
every slot waits for).  The figure is completion tokens per second of wall time over the set
(prefill included: what a server's clients get), for P = 1 (queued), 2, 4, 8 in the default and
the exact mode, and P = 4, 8 with speculation off (batching alone).  Configurations are
interleaved round by round.  Every answer is compared with the queued run's: in exact mode they
must be identical (the mode's promise, joint batches included); in the default mode the count
shows how often batch numerics moved a near-tie.

Usage: python3 bench/bench_concurrent.py [--rounds 2] [--tokens 64] [--out bench/results/concurrent.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_adaptive import PROSE
from llama_cpp import _logger

import llama_dflash
from llama_dflash.api.models import default_target, shipped_drafter
from llama_dflash.train.prompts import chatml, humaneval_prompts

CLIENTS = 8
SHORT = ["Once upon a time", "The history of Rome", "def quicksort(xs):", "My favourite recipe is",
         "In the year 2050,", "import torch\n", "Dear diary,", "The best way to learn a language is",
         "SELECT * FROM", "A poem about the sea:", "class Stack:", "The weather today",
         "Ten facts about cats:", "How to fix a bike:", "The meaning of life", "<html>\n"]


def configs() -> list[tuple[str, dict]]:
    out = []
    for mode in ("default", "exact"):
        for p in (1, 2, 4, 8):
            out.append((f"{mode}/parallel={p}", dict(parallel=p, exact=mode == "exact")))
    for p in (4, 8):
        out.append((f"default/parallel={p}/speculation=off", dict(parallel=p, speculation="off")))
    return out


def run_set(llm, prompts: list[str], tokens: int) -> tuple[float, list[str], int]:
    """All prompts from CLIENTS threads at once: (wall seconds, texts, completion tokens)."""
    def one(p: str):
        who = llm.view() if llm.parallel > 1 else llm  # queued: every client on the model itself
        r = who.create_completion(p, max_tokens=tokens, temperature=0.0)
        return r["choices"][0]["text"], r["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as ex:
        got = list(ex.map(one, prompts))
    return time.perf_counter() - t0, [t for t, _ in got], sum(n for _, n in got)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "concurrent.json"))
    a = ap.parse_args()
    _logger.set_verbose(False)
    sets = {"short": SHORT, "chat": [chatml(p.text) for p in humaneval_prompts()[:8]] + [chatml(p) for p in PROSE[:8]]}
    models = {name: llama_dflash.Llama(str(default_target()), draft_model_path=str(shipped_drafter()), n_ctx=512,
                                       n_threads=2, verbose=False, **kw) for name, kw in configs()}
    for llm in models.values():  # warm-up: cost models measured / loaded, pages touched
        run_set(llm, SHORT[:2], 8)
    rates: dict[tuple[str, str], list[float]] = {(s, k): [] for s in sets for k in models}
    texts: dict[tuple[str, str], list[str]] = {}
    drafted = {k: [0, 0] for k in rates}
    for r in range(a.rounds):
        for sname, prompts in sets.items():
            for name, llm in models.items():
                before = dict(llm.joint_stats)
                tot0 = (llm.speculative_stats_total.drafted, llm.speculative_stats_total.accepted)
                secs, out, n = run_set(llm, prompts, a.tokens)
                rates[sname, name].append(n / secs)
                texts.setdefault((sname, name), out)
                js, tot = llm.joint_stats, llm.speculative_stats_total
                drafted[sname, name][0] += tot.drafted - tot0[0]
                drafted[sname, name][1] += tot.accepted - tot0[1]
                steps = js["joint_steps"] - before["joint_steps"]
                occ = (js["joint_sequences"] - before["joint_sequences"]) / steps if steps else 1.0
                print(f"round {r} {sname:5s} {name:36s} {n / secs:7.1f} tok/s  ({n} tokens in {secs:5.2f} s, "
                      f"{occ:4.2f} sequences per joint decode)", flush=True)
    res = {"command": "python3 bench/bench_concurrent.py " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "clients": CLIENTS,
           "requests": len(SHORT), "tokens": a.tokens, "threads": 2, "results": {}}
    for sname in sets:
        for name in models:
            mode = name.split("/")[0]
            base = statistics.median(rates[sname, f"{mode}/parallel=1"])
            med = statistics.median(rates[sname, name])
            same = sum(x == y for x, y in zip(texts[sname, name], texts[sname, f"{mode}/parallel=1"], strict=True))
            res["results"][f"{sname}/{name}"] = {
                "tokens_per_s": round(med, 1), "vs_queued": round(med / base, 3),
                "rounds": [round(x, 1) for x in rates[sname, name]], "drafted": drafted[sname, name][0],
                "accepted": drafted[sname, name][1], "identical_to_queued": same, "compared": len(sets[sname])}
            print(f"{sname:5s} {name:36s} {med:7.1f} tok/s  x{med / base:.2f} vs queued  identical "
                  f"{same}/{len(sets[sname])}")
    for llm in models.values():
        llm.close()
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""Concurrent requests: served in turn, or together with their steps sharing one decode (issue: robustness / load).

A server with several requests in flight either queues them (one generation at a time: what
``parallel=1`` does, and what the server did before) or serves them together
(``Llama(parallel=P)``: up to P at once, one ``llama_decode`` verifying every active sequence's
draft; core/group.py).  Here 8 client threads send 16 distinct requests (HumanEval problems and
prose, greedy, --tokens each) to one model; the figure is completion tokens per second of wall
time over the whole set (prefill included: what a server's clients get), for P = 1, 2, 4, 8, in
the default and the exact mode, and P = 4 with speculation off (batching alone).  Configurations
are interleaved round by round.  In exact mode every answer is also compared with the queued run's
(bit-identical output is the mode's promise, joint batches included).

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


def configs() -> list[tuple[str, dict]]:
    out = []
    for mode in ("default", "exact"):
        for p in (1, 2, 4, 8):
            out.append((f"{mode}/parallel={p}", dict(parallel=p, exact=mode == "exact")))
    out.append(("default/parallel=4/speculation=off", dict(parallel=4, speculation="off")))
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
    prompts = [chatml(p.text) for p in humaneval_prompts()[:8]] + [chatml(p) for p in PROSE[:8]]
    models = {name: llama_dflash.Llama(str(default_target()), draft_model_path=str(shipped_drafter()), n_ctx=512,
                                       n_threads=2, verbose=False, **kw) for name, kw in configs()}
    for llm in models.values():  # warm-up: cost models measured / loaded, pages touched
        run_set(llm, prompts[:2], 8)
    rates: dict[str, list[float]] = {k: [] for k in models}
    texts: dict[str, list[str]] = {}
    for r in range(a.rounds):
        for name, llm in models.items():
            before = dict(llm.joint_stats)
            secs, out, n = run_set(llm, prompts, a.tokens)
            rates[name].append(n / secs)
            texts.setdefault(name, out)
            js = llm.joint_stats
            steps = js["joint_steps"] - before["joint_steps"]
            occ = (js["joint_sequences"] - before["joint_sequences"]) / steps if steps else 1.0
            tot = llm.speculative_stats_total
            print(f"round {r} {name:36s} {n / secs:7.1f} tok/s  ({n} tokens in {secs:5.2f} s, "
                  f"{occ:4.2f} sequences per joint decode, drafted {tot.drafted} accepted {tot.accepted} so far)",
                  flush=True)
    base = {m: statistics.median(rates[f"{m}/parallel=1"]) for m in ("default", "exact")}
    res = {"command": "python3 bench/bench_concurrent.py " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "clients": CLIENTS,
           "requests": len(prompts), "tokens": a.tokens, "threads": 2, "results": {}}
    for name, llm in models.items():
        mode = name.split("/")[0]
        tot = llm.speculative_stats_total
        row = {"tokens_per_s": round(statistics.median(rates[name]), 1),
               "vs_queued": round(statistics.median(rates[name]) / base[mode], 3),
               "rounds": [round(x, 1) for x in rates[name]], "drafted": tot.drafted, "accepted": tot.accepted,
               **llm.joint_stats}
        if mode == "exact":
            row["identical_to_queued"] = sum(x == y for x, y in zip(texts[name], texts["exact/parallel=1"],
                                                                      strict=True))
            row["compared"] = len(prompts)
        res["results"][name] = row
        print(f"{name:36s} {row['tokens_per_s']:7.1f} tok/s  x{row['vs_queued']:.2f} vs queued"
              + (f"  identical {row['identical_to_queued']}/{len(prompts)}" if mode == "exact" else ""))
    for llm in models.values():
        llm.close()
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""What a draft-length policy can reach with this drafter on this machine, from dense traces.

For every position of each prompt's plain greedy output, the drafter's n_max-token draft from there
(with the DFlash2 walk's per-slot confidences, what adaptive steps calibrate) and how many of its
tokens the output continues with.  Greedy output is the plain one under every length policy (exact
mode; the default mode rounds some near ties apart), so on these traces the steps of any policy, and
the cost model's time for them, follow -- exactly, but for two things: a draft of n < n_max tokens
is a block of n + 1 rows that attend to each other, so it need not be the long draft's start (the
share of positions where a 3-token draft is, is reported); and the replay takes every draft as
returned whole (no p_min, n_min or grammar cut).  The policies:

  - the oracle: dynamic programming over positions, knowing every draft's acceptance; it commits
    exactly what will be accepted -- drafting and verifying that, or more where a larger batch costs
    less -- or steps plainly (bench_adaptive's ceiling, made exact);
  - causal policies, which know only what their own drafts showed them: draft n tokens, then cut
    the draft to the k with the most expected committed tokens net of the rows' time at the plain
    rate, the confidences calibrated on these same traces (optimistic for them); either every
    step ("always n"), or only while the last draft got at least A tokens accepted, with a probe
    draft every P plain steps ("streak");
  - the same causal policies with free drafts (t_draft = 0): what the confidence signal is worth
    by itself, whatever the drafter's cost.

Beside them, measured in the same run, interleaved prompt by prompt (decode tok/s, prefill
excluded): our plain loop and our adaptive loop (speculation "auto", the default).  The cost model
is the engine's own, measured and refined by those runs.  Greedy, and T = 0.7 with match
verification: a draft is kept while it equals the sample, and the samples are plain decoding's for
the same seed, so the sampled output is traced as the greedy one is (the drafter drafts greedily
either way).  Needs a DFlash2 drafter (the confidences come from its lattice).

Usage: python3 bench/bench_policy.py [--problems 20] [--prose 20] [--tokens 128] [--temps greedy,t0.7]
                                     [--out bench/results/policy.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
from bench_adaptive import PROSE
from bench_humaneval import SAMPLING

from llama_dflash import SamplingParams, SpeculativeGenerator
from llama_dflash._native import lib
from llama_dflash.api.models import default_target, shipped_drafter
from llama_dflash.core import policy
from llama_dflash.core.drafter import walk_lattice
from llama_dflash.train.prompts import chatml, humaneval_prompts

BINS = int(lib.DFLASH_CAL_BINS)  # confidence bins of the calibration (the engine's)
SHORT = 3  # a shorter draft compared with the long one's first tokens (the block attends both ways)


def dense_trace(g: SpeculativeGenerator, prompt: list[int], gen: list[int], n_max: int,
                margins: list[float]) -> list[dict]:
    """At every anchor gen[j]: the drafter's n_max-token draft (its context: every position before
    the anchor), its confidences (the engine's, and the walk's softmax alone), how many of its tokens
    equal gen[j+1:], whether a SHORT-token draft is the long one's start, and the target's top-1 minus
    top-2 logit on the row that gave the anchor (known before drafting)."""
    d = g.drafter
    feats = g.features(prompt + gen)
    d.reset()
    d.push(feats[: len(prompt)])
    out = []
    for j in range(len(gen) - 1):
        ids, conf = d.draft(gen[j], n_max, return_conf=True)
        walk = walk_lattice(*d.last_lattice())[1]
        short = d.draft(gen[j], SHORT)
        ref, a = gen[j + 1: j + 1 + n_max], 0
        while a < len(ids) and a < len(ref) and ids[a] == ref[a]:
            a += 1
        out.append({"a": a, "conf": conf, "walk": [float(c) for c in walk], "prefix": short == ids[:SHORT],
                    "m": float(margins[j])})
        d.push(feats[len(prompt) + j: len(prompt) + j + 1])
    return out


def _bin(c: float) -> int:
    return min(BINS - 1, max(0, int(c * BINS)))


def calibration(traces: list[list[dict]], n_max: int) -> np.ndarray:
    """P(slot i accepted | slots before it accepted, its confidence bin), fitted on the traces."""
    reach, acc = np.zeros((n_max, BINS)), np.zeros((n_max, BINS))
    for tr in traces:
        for x in tr:
            for i in range(min(x["a"] + 1, len(x["conf"]))):
                reach[i, _bin(x["conf"][i])] += 1
                acc[i, _bin(x["conf"][i])] += i < x["a"]
    return (acc + 1) / (reach + 2)


def oracle_time(tr: list[dict], tv: list[float], td: list[float], n_max: int) -> float:
    """The least cost-model time to commit the trace's tokens, knowing every acceptance: k of a
    draft's accepted tokens committed by drafting and verifying k, or more (up to n_max) where that
    costs less (the CPU's 4-row tiles), or a plain step.  tv[k]: k + 1 rows; td[k]: k tokens."""
    n = len(tr)
    step = [min(td[m] + tv[m] for m in range(k, n_max + 1)) for k in range(n_max + 1)]  # k >= 1 used
    dp = [0.0] * (n + 1)
    for j in range(n - 1, -1, -1):
        dp[j] = tv[0] + dp[j + 1]
        for k in range(1, tr[j]["a"] + 1):
            dp[j] = min(dp[j], step[k] + dp[min(n, j + k + 1)])
    return dp[0]


def cut(cal: np.ndarray, conf: list[float], tv: list[float]) -> int:
    """The k (0 .. len(conf)) with the most expected committed tokens net of the verify rows' time
    at the plain rate (the draft is already paid for)."""
    rate = 1.0 / tv[0]
    e, prod, best, best_k = 1.0, 1.0, 1.0 - rate * tv[0], 0
    for k in range(1, len(conf) + 1):
        prod *= cal[k - 1, _bin(conf[k - 1])]
        e += prod
        if e - rate * tv[k] > best:
            best, best_k = e - rate * tv[k], k
    return best_k


def causal_time(tr: list[dict], cal: np.ndarray, tv: list[float], td: list[float], n: int,
                min_acc: int | None = None, probe_every: int = 0) -> float:
    """Cost-model time of a causal policy on one trace: draft n tokens (every step, or while the
    last draft got >= min_acc accepted, probing every probe_every plain steps), cut by confidence."""
    j, t, on, skipped = 0, 0.0, True, 0
    while j < len(tr):
        if min_acc is not None and not on:
            skipped += 1
            if skipped < probe_every:
                t += tv[0]
                j += 1
                continue
            skipped = 0
        x = tr[j]
        k = cut(cal, x["conf"][:n], tv)
        got = min(k, x["a"])
        t += td[n] + tv[k]
        j += got + 1
        if min_acc is not None:
            on = got >= min_acc
    return t


# What a step shows before the next one drafts: nothing (a plain step), a draft cut to nothing, a
# rejection after g accepted, or every verified slot accepted -- and then, where the draft went on
# past the cut, whether its next slot equals the token the target committed after them ("shadow").
GATE_CELLS = {
    # (the engine's: nothing verified / first slot rejected / 1-2 accepted / 3 or more accepted)
    "state": lambda st: 0 if st[0] in ("plain", "cut0") else (1 if st[0] == "rej" and st[1] == 0
                                                               else (2 if st[-1] < 3 else 3)),
    "state+shadow": lambda st: st[0] + (f"/{st[1]}" if st[0] in ("all", "rej") else ""),
}


def gated_time(tr: list[dict], cal: np.ndarray, tv: list[float], td: list[float], n: int, cell, table: dict) -> float:
    """Cost-model time of a causal policy that drafts n tokens (cut by confidence) where table[cell(what
    the last step showed)] says so, and steps plainly elsewhere."""
    j, t, st = 0, 0.0, ("plain",)
    while j < len(tr):
        x = tr[j]
        if not table.get(cell(st), True):
            t += tv[0]
            j += 1
            st = ("plain",)
            continue
        k = cut(cal, x["conf"][:n], tv)
        got = min(k, x["a"])
        t += td[n] + tv[k]
        j += got + 1
        st = (("cut0",) if k == 0 else ("rej", min(got, 3)) if got < k
              else ("all", x["a"] > k, min(got, 3)) if n > k else ("all", None, min(got, 3)))
    return t


def best_gated(traces: list[list[dict]], cal: np.ndarray, tv: list[float], td: list[float], n: int,
               cell) -> tuple[float, dict]:
    """The best gate table for these traces (coordinate ascent from drafting everywhere): fitted on
    the traces it is scored on (optimistic for it); without probes, a table that never drafts after a
    plain step never drafts again."""
    states = [("plain",), ("cut0",), *(("rej", g) for g in range(4)),
              *(("all", s, g) for s in (False, True, None) for g in (1, 2, 3))]
    cells = sorted({cell(st) for st in states}, key=str)
    plain = sum(len(tr) for tr in traces) * tv[0]
    table = dict.fromkeys(cells, True)

    def score() -> float:
        return plain / sum(gated_time(tr, cal, tv, td, n, cell, table) for tr in traces)

    cur = score()
    for _ in range(3):
        changed = False
        for c in cells:
            table[c] = not table[c]
            x = score()
            if x > cur + 1e-9:
                cur, changed = x, True
            else:
                table[c] = not table[c]
        if not changed:
            break
    return cur, {str(k): v for k, v in table.items()}


def replay_time(traces: list[list[dict]], tv: list[float], td: list[float], n_max: int,
                t_inject_row: float = 0.0) -> float:
    """Cost-model time of the engine's own adaptive steps on the traces (core.policy.replay: one
    policy state throughout, a warm-up pass over them first; each draft also pays t_inject_row per
    row committed since the last one, as the engine's drafts inject them first)."""
    r = policy.replay([[(x["a"], x["conf"]) for x in tr] for tr in traces], tv, td[1:], n_max, passes=2,
                      t_inject_row=t_inject_row)
    return r["seconds"]


def inject_cost(drafter: str, rows: int = 64, reps: int = 12) -> float:
    """Seconds a draft pays per queued feature row: a draft after `rows` rows against one after a
    single row, each right after a target decode (as in the loop: the drafter's weights read cold)."""
    import statistics

    import llama_cpp

    from llama_dflash.core.drafter import Drafter

    llm = llama_cpp.Llama(str(default_target()), n_ctx=2048, n_threads=2, verbose=False)
    d = Drafter(drafter, llm.model, n_ctx=4096, n_threads=2)
    feats = np.random.default_rng(0).standard_normal((512, d.info.n_taps * d.info.n_embd)).astype(np.float32)
    t = {1: [], rows: []}
    for i in range(reps):
        for m in (1, rows):
            d.reset()
            d.push(feats[:256])
            d.draft(100, 3)
            if llm.n_tokens > 1900:
                llm.reset()
            llm.eval([100 + i % 50])
            t0 = time.perf_counter()
            d.push(feats[256:256 + m])
            d.draft(100, 3)
            t[m].append(time.perf_counter() - t0)
    d.close()
    llm.close()
    return max(0.0, (statistics.median(t[rows]) - statistics.median(t[1])) / (rows - 1))


def policies(traces: list[list[dict]], tv: list[float], td: list[float], n_max: int,
             t_inject_row: float = 0.0) -> dict:
    cal = calibration(traces, n_max)
    plain = sum(len(tr) for tr in traces) * tv[0]
    walk = [[{"a": x["a"], "conf": x["walk"]} for x in tr] for tr in traces]
    res = {"oracle": plain / sum(oracle_time(tr, tv, td, n_max) for tr in traces),
           "engine_replay": plain / replay_time(traces, tv, td, n_max, t_inject_row),
           "engine_replay_walk_conf": plain / replay_time(walk, tv, td, n_max, t_inject_row)}
    gated = {}
    for n in sorted({3, min(4, n_max)}):
        for name, cell in GATE_CELLS.items():
            x, table = best_gated(traces, cal, tv, td, n, cell)
            gated[f"n={n} {name}"] = {"x": round(x, 4), "draft_in": table}
    best = max(gated, key=lambda k: gated[k]["x"])
    res["gated"] = {"best": best, "best_x": gated[best]["x"], "all": gated}
    for free in (False, True):
        tdx = [0.0] * len(td) if free else td
        rows = {}
        for n in sorted({1, 3, n_max}):
            rows[f"always n={n}"] = plain / sum(causal_time(tr, cal, tv, tdx, n) for tr in traces)
        for a in (1, 2, 3):
            for p in (4, 8, 16, 32):
                rows[f"streak A={a} P={p}"] = plain / sum(causal_time(tr, cal, tv, tdx, n_max, a, p) for tr in traces)
        best = max(rows, key=rows.get)
        res["free_drafts" if free else "causal"] = {"best": best, "best_x": round(rows[best], 4),
                                                    "all": {k: round(v, 4) for k, v in rows.items()}}
    return res


def collect(a) -> dict:
    """Measure plain and adaptive, interleaved prompt by prompt, and trace every prompt densely."""
    drafter = a.drafter or str(shipped_drafter())
    g = SpeculativeGenerator(str(default_target()), drafter, n_threads=2)
    if g.drafter.info.version != 2:
        sys.exit("bench_policy needs a DFlash2 drafter")
    n_max = g.max_draft_len
    base = {"humaneval": [chatml(p.text) for p in humaneval_prompts()[: a.problems]],
            "prose": [chatml(p) for p in PROSE[: a.prose]]}
    # at T > 0 match verification keeps a draft while it equals the sample, and the samples are plain
    # decoding's for the same seed: the sampled output is traced as the greedy one is
    sets = {f"{name}{suffix}": (prompts, t) for name, prompts in base.items()
            for suffix, t in (("", False), ("_t0.7", True)) if t in a.temps}
    g.generate(g.tokenize(next(p for ps in base.values() for p in ps)), 16)  # the cost model, before any timing
    res = {"command": "python3 " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "tokens": a.tokens, "n_max": n_max, "target": default_target().name, "drafter": Path(drafter).name,
           "sets": {}, "traces": {}}
    t0 = time.time()
    for name, (prompts, sampled) in sets.items():
        traces, meas = [], {"plain": [0, 0.0], "auto": [0, 0.0], "auto_plain_steps": 0, "auto_steps": 0,
                            "auto_predicted_s": 0.0, "auto_measured_s": 0.0, "identical": 0}
        for i, text in enumerate(prompts):
            toks = g.tokenize(text)
            sp = SamplingParams(seed=1000 + i, **SAMPLING) if sampled else None
            plain = g.generate(toks, a.tokens, draft_len=0, sampling=sp, return_margins=True)
            auto = g.generate(toks, a.tokens, sampling=sp)
            meas["identical"] += auto.tokens == plain.tokens  # (default mode: near ties may round apart)
            for key, r in (("plain", plain), ("auto", auto)):
                meas[key][0] += max(0, r.stats.n_generated - 1)
                meas[key][1] += r.stats.t_total_s
            s = auto.stats
            meas["auto_plain_steps"] += s.plain_steps
            meas["auto_steps"] += s.steps
            meas["auto_predicted_s"] += s.t_predicted_s
            meas["auto_measured_s"] += s.t_draft_s + s.t_verify_s
            traces.append(dense_trace(g, toks, plain.tokens, n_max, plain.margins))
            print(f"  {name} [{i + 1}/{len(prompts)}] {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        res["traces"][name] = traces
        res["sets"][name] = {"measured": meas}
    cm = g.cost_model()
    res["cost_model_ms"] = {k: [round(1e3 * x, 4) for x in cm[k]] for k in ("t_verify", "t_draft")}
    g.close()
    res["inject_ms_per_row"] = round(1e3 * inject_cost(drafter), 5)
    return res


def analyse(res: dict) -> None:
    """Each set's policies on its traces, under the run's cost model (in place)."""
    tv = [x / 1e3 for x in res["cost_model_ms"]["t_verify"]]
    td = [0.0, *(x / 1e3 for x in res["cost_model_ms"]["t_draft"])]
    for name, s in res["sets"].items():
        m, traces = s["measured"], res["traces"][name]
        plain_rate, auto_rate = m["plain"][0] / m["plain"][1], m["auto"][0] / m["auto"][1]
        pol = policies(traces, tv, td, res["n_max"], res.get("inject_ms_per_row", 0.0) / 1e3)
        s["summary"] = sm = {
            "positions": sum(len(tr) for tr in traces),
            "mean_accepted": round(float(np.mean([x["a"] for tr in traces for x in tr])), 3),
            "oracle_x": round(pol["oracle"], 4), "engine_replay_x": round(pol["engine_replay"], 4),
            "engine_replay_walk_conf_x": round(pol["engine_replay_walk_conf"], 4),
            "short_draft_is_prefix": round(float(np.mean([x["prefix"] for tr in traces for x in tr])), 4),
            "causal": pol["causal"], "gated": pol["gated"], "free_drafts": pol["free_drafts"],
            "plain_tok_s": round(plain_rate, 2), "auto_x": round(auto_rate / plain_rate, 4),
            "auto_plain_steps": f"{m['auto_plain_steps']} of {m['auto_steps']}",
            "auto_predicted_over_measured": round(m["auto_predicted_s"] / m["auto_measured_s"], 4),
            "auto_identical_to_plain": f"{m['identical']} of {len(traces)}",
        }
        print(f"{name}: oracle {sm['oracle_x']:.3f}x; best causal {sm['causal']['best_x']:.3f}x "
              f"({sm['causal']['best']}); best gate fitted on these traces {sm['gated']['best_x']:.3f}x "
              f"({sm['gated']['best']}); the engine's policy replayed {sm['engine_replay_x']:.3f}x; "
              f"with free drafts {sm['free_drafts']['best_x']:.3f}x (60 % of the oracle's gain: "
              f"{1 + 0.6 * (sm['oracle_x'] - 1):.3f}x); measured adaptive {sm['auto_x']:.3f}x "
              f"of plain {sm['plain_tok_s']:.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--prose", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temps", default="greedy,t0.7", help="greedy and / or t0.7 (match verification, seeded)")
    ap.add_argument("--drafter", default="", help="a DFlash2 drafter GGUF (default: the shipped one)")
    ap.add_argument("--traces", default="", help="the run's traces and measurements: written there, or, when the "
                    "file exists, read back and analysed again (e.g. after a policy change) without running anything")
    ap.add_argument("--inject-ms-per-row", type=float, default=None,
                    help="with --traces read back: the injection cost per queued row to replay with (a new run "
                         "measures it)")
    ap.add_argument("--out", default="bench/results/policy.json")
    a = ap.parse_args()
    temps = a.temps.split(",")
    if not temps or not set(temps) <= {"greedy", "t0.7"}:
        ap.error(f"--temps takes greedy and / or t0.7, not {a.temps!r}")
    a.temps = {t == "t0.7" for t in temps}
    tf = Path(a.traces) if a.traces else None
    if tf and tf.is_file():
        res = json.loads(tf.read_text())
        res["analysed"] = f"python3 {' '.join(sys.argv)} at {datetime.datetime.now().isoformat(timespec='seconds')}"
        if a.inject_ms_per_row is not None:
            res["inject_ms_per_row"] = a.inject_ms_per_row
    else:
        res = collect(a)
        if tf:
            tf.write_text(json.dumps(res))
    analyse(res)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: v for k, v in res.items() if k != "traces"}, indent=1))


if __name__ == "__main__":
    main()

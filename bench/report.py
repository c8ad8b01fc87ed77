"""Render the saved benchmark results (bench/results/*.json) as bench/RESULTS.md.

Usage:
    python3 bench/report.py            # writes bench/RESULTS.md
    python3 bench/report.py --check    # exit status 1 if bench/RESULTS.md is not what the json gives
    python3 bench/report.py --stdout   # print instead of writing

Every table and every number in the generated text comes from one json file, and each section
names the command that wrote that file and the date recorded in it.  Re-run a benchmark, then
this script; do not edit bench/RESULTS.md by hand.  The only text that is not computed here is
the closing section of results measured by hand (no json holds them), kept verbatim with dates.
Standard library only: it runs without the package installed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
HERE = BENCH / "results"
OUT = BENCH / "RESULTS.md"


def _load(name: str) -> dict:
    return json.loads((HERE / name).read_text())


def _opt(command: str, flag: str, default: str) -> str:
    """The value of `flag` in a recorded command line, or `default` when it was not given."""
    parts = command.split()
    return parts[parts.index(flag) + 1] if flag in parts[:-1] else default


def _source(command: str, date: str, json_name: str, extra: str = "") -> str:
    return f"`{command}` → `bench/results/{json_name}`, recorded {date}{extra}."


# ---------------------------------------------------------------------------------------------
# core.json: capture cost, drafter step vs upstream, verify cost, loop overhead, reduced vocab


def core() -> list[str]:
    r = _load("core.json")
    d = r["decode_tok_s"]
    out = ["## Core: capture, drafter step, verification, loop", "",
           _source(r["command"], r["date"], "core.json", f" ({r['machine']}, {r['threads']} threads)"),
           f"Target {r['target']}; random-weight drafters of matching shape (hidden 576, 5 taps, f16 weights). "
           "Every ratio is measured side by side in that one run (machine noise here is ±10–15 % run to run).",
           "", "| target decode, plain, 128 tokens | tok/s |", "|---|---|"]
    for k, lab in [("no_capture", "no capture"), ("layer_inp", "layer-input capture, 5 taps"),
                   ("cb_eval", "cb_eval capture, 5 taps")]:
        out.append(f"| {lab} | {d[k]:.1f} |")
    out += ["", "Capture costs nothing measurable (the three are within noise; rounds are interleaved).", "",
            "| drafter step (inject n+1 rows + draft n) | ours ms | upstream ms | ours / upstream |",
            "|---|---|---|---|"]
    for k, v in r["drafter_step"].items():
        layers, n = k.split("_")
        out.append(f"| DFlash, {layers[:-1]} layers, n = {n[1:]} | {v['ours_ms']:.2f} | {v['upstream_ms']:.2f} | "
                   f"{v['ours_over_upstream']:.2f} |")
    for k, v in r["dflash2_step"].items():
        out.append(f"| DFlash2, 2 layers, n = {k[1:]} | {v['v2_ms']:.2f} | {v['upstream_v2_ms']:.2f} | "
                   f"{v['ours_over_upstream']:.2f} |")
    ratios = [v["ours_over_upstream"] for v in r["drafter_step"].values()] + \
        [v["ours_over_upstream"] for v in r["dflash2_step"].values()]
    out += ["", f"Ours / upstream ranges from {min(ratios):.2f} to {max(ratios):.2f} over these shapes.",
            "Upstream is libllama's `dflash` graph with llama.cpp's defaults (f16 cache, flash attention auto),",
            "driven the same way (push n+1 feature rows, draft n, drop the noise block; DFlash2: read the lattice and",
            "walk).", "", "| DFlash2 vs DFlash v1 on the same backbone (ours) | n = 3 | n = 7 | n = 15 |",
            "|---|---|---|---|",
            "| step time v2 / v1 | " + " | ".join(f"{r['dflash2_step'][k]['v2_over_v1']:.2f}"
                                               for k in ("n3", "n7", "n15")) + " |",
            "", "The convolutions and the selector (K = 16, rank 256, top-K over the 49152-token vocabulary) cost "
            "the v2 / v1 ratio above (goal < 10 %).", ""]
    ratio = r["verify"]["ratio"]
    out += ["| verify rows k | " + " | ".join(str(k) for k in ratio) + " |", "|---|" + "---|" * len(ratio),
            "| t(k)/t(1) | " + " | ".join(f"{v:.2f}" for v in ratio.values()) + " |", "",
            f"t(1) = {r['verify']['t_ms']['1']:.1f} ms. A draft of n tokens pays off only when τ exceeds "
            "t(n+1)/t(1) plus the draft time over t(1).", "",
            "| loop with a replay drafter (fixed per-token acceptance) | τ | loop overhead beyond draft + verify |",
            "|---|---|---|"]
    for k, v in r["loop_overhead"].items():
        n, a = k.split("_")
        out.append(f"| n = {n[1:]}, acceptance {a[1:]} | {v['tau']:.2f} | {100 * v['overhead_frac']:.2f} % |")
    out += ["", "Goal for the loop overhead was < 5 %.", ""]
    if "reduced_vocab" in r:
        rv = r["reduced_vocab"]
        out += ["### Reduced draft vocabularies", "",
                f"`{rv['command']}` → merged into `bench/results/core.json`, recorded {rv['date']}: the same random "
                "DFlash2 drafter (2 layers, K = 16) with the target's whole head and reduced to its first N tokens "
                "(d2t + own head rows copied from the target's Q8_0 head), ours and upstream on the same files:", "",
                "| draft vocabulary | n = 3: ours ms | upstream ms | ours / upstream | n = 7: ours ms | upstream ms | "
                "ours / upstream |", "|---|---|---|---|---|---|---|"]
        for size in sorted({v["draft_vocab"] for v in rv["steps"].values()}, reverse=True):
            cells = []
            for n in (3, 7):
                v = rv["steps"][f"v{size}_n{n}"]
                cells += [f"{v['ours_ms']:.2f}", f"{v['upstream_ms']:.2f}", f"{v['ours_over_upstream']:.2f}"]
            out.append(f"| {size} | " + " | ".join(cells) + " |")
        out += ["", "Upstream scatters the reduced logits back to all 49152 tokens and takes the top-K there; ours",
                "takes it among the reduced rows and maps the K winners.", ""]
    if "inloop" in r:
        il = r["inloop"]
        out += ["### A drafter step in the loop's shape", "",
                f"`{il['command']}` → merged into `bench/results/core.json`, recorded {il['date']} "
                f"(target SmolLM2-135M-Instruct {il['target_ftype'].upper()}): before every step the target verifies "
                "n + 1 rows, as in the loop (its weights go through the caches and the drafter's are read cold), then "
                "one feature row is injected and n tokens drafted; ours and upstream's graph take turns on the same "
                "file, after the given rows of context in the drafter's cache (256 where not given). Median ms:", "",
                "| drafter | n | context | ours ms | upstream ms | ours / upstream |", "|---|---|---|---|---|---|"]
        names = {"v1_2l_full_vocab": "DFlash v1, 2 layers, the target's 49152-token head (f16 weights)",
                 "shipped": "the shipped drafter (DFlash2, 8192-token head, q4_0)"}
        for k, v in il["steps"].items():
            k, _, ctx = k.partition("_ctx")
            name, n = k.rsplit("_n", 1)
            out.append(f"| {names.get(name, name)} | {n} | {ctx or 256} | {v['ours_ms']:.2f} | "
                       f"{v['upstream_ms']:.2f} | {v['ours_over_upstream']:.2f} |")
        out += ["", "Upstream's step here reads no logits (`return_logits=False`): its own loop would also sample them "
                "on the host.", ""]
    return out


def quant() -> list[str]:
    """quant.json: one drafter in several weight types, side by side in the loop."""
    path = HERE / "quant.json"
    if not path.is_file():
        return []
    r = _load("quant.json")
    types = list(r["bytes"])
    out = ["### Drafter weight types", "",
           _source(r["command"], r["date"], "quant.json", f" ({r['threads']} threads, {r['wall_s']} s)"),
           f"The first {r['problems']} HumanEval problems in the chat template, greedy, up to {r['tokens']} tokens; "
           "the same drafter with its matrices re-encoded by `llama-dflash quantize` (norms, conv bases and codebooks "
           "f32), every configuration on each prompt in turn. Decode tok/s against our plain loop in the same run.",
           "", "| drafter | file MiB | configuration | tok/s | vs plain | τ | draft / verify ms per step | "
           "acceptance per position |", "|---|---|---|---|---|---|---|---|"]
    p = r["results"]["plain"]
    out.append(f"| — | | plain | {p['tok_s']:.1f} | 1.000 | 1.00 | 0.00 / {p['verify_ms_per_step']:.2f} | |")
    for t in types:
        for key, v in r["results"].items():
            if not key.startswith(t + " "):
                continue
            acc = ", ".join(f"{x:.2f}" for x in v["acceptance"][:7])
            out.append(f"| {t} | {r['bytes'][t] / 2**20:.1f} | {key[len(t) + 1:]} | {v['tok_s']:.1f} | "
                       f"{v['vs_plain']:.3f} | {v['tau']:.2f} | {v['draft_ms_per_step']:.2f} / "
                       f"{v['verify_ms_per_step']:.2f} | {acc} |")
    out.append("")
    return out


def convert() -> list[str]:
    c = _load("convert.json")
    return ["## Converter", "", _source(c["command"], c["date"], "convert.json"), "",
            f"A synthetic {c['checkpoint_bytes_bf16'] / 1e9:.2f} GB bf16 checkpoint → f16 GGUF "
            f"({c['output_bytes_f16'] / 1e9:.2f} GB) in {c['seconds']:.0f} s at "
            f"{c['peak_rss_bytes'] / 2**20:.0f} MiB ({c['peak_rss_bytes'] / 1e6:.0f} MB) peak RSS; its largest "
            f"tensor is {c['largest_tensor_bytes_f32'] / 2**20:.0f} MiB ({c['largest_tensor_bytes_f32'] / 1e6:.0f} MB) "
            "as f32. Tensors are converted chunk by chunk, so the peak stays below one whole f32 tensor.", ""]


# ---------------------------------------------------------------------------------------------
# humaneval.json (+ the previous drafter's rerun, heldout.json): the shipped drafter

_HE_LABELS = {"llama_cpp_greedy": "llama-cpp-python, greedy", "ours_plain_greedy": "ours, plain (no drafter), greedy",
              "llama_cpp_t0.7": "llama-cpp-python, T = 0.7"}


def _he_label(k: str) -> str:
    return _HE_LABELS.get(k) or ("ours, " + k.replace("greedy_n", "greedy, n = ").replace("t0.7_", "T = 0.7 ")
                                 .replace("_n", ", n = "))


def _he_table(h: dict) -> list[str]:
    out = ["| configuration | decode tok/s | vs llama-cpp-python | τ | draft / verify ms per step | "
           "acceptance per position |", "|---|---|---|---|---|---|"]
    for k, r in h["results"].items():
        ms = f"{r['draft_ms_per_step']:.1f} / {r['verify_ms_per_step']:.1f}" if "verify_ms_per_step" in r else ""
        pp = ", ".join(f"{x:.2f}" for x in r.get("per_position", []) if x is not None)
        out.append(f"| {_he_label(k)} | {r['tok_s']:.1f} | {r['speedup_vs_llama_cpp']:.2f}x | {r.get('tau', 1.0):.2f} "
                   f"| {ms} | {pp} |")
    return out


def _span(xs: list[float], fmt: str = ".2f", unit: str = "") -> str:
    """'lo–hi' (or one value when they print alike); signed formats use ' … ' as the dash."""
    lo, hi = min(xs), max(xs)
    dash = " … " if fmt.startswith("+") else "–"
    return f"{lo:{fmt}}{unit}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}{dash}{hi:{fmt}}{unit}"


def _gap(v: float | None) -> str:
    return "" if v is None else f"{v:+.4f}"


def humaneval() -> list[str]:
    h = _load("humaneval.json")
    R = h["results"]
    s = h["sampling"]
    g = {int(k[len("greedy_n"):]): R[k] for k in R if k.startswith("greedy_n")}
    plain_ours = R["ours_plain_greedy"]
    n_best = max(g, key=lambda n: g[n]["speedup_vs_llama_cpp"])
    gb = g[n_best]
    out = ["## The shipped drafter on HumanEval (held out)", "",
           _source(h["command"], h["date"], "humaneval.json", f" at the end of a {h['wall_s']:.0f} s run "
                                                                 f"({h['machine']})"),
           f"The first {h['problems']} HumanEval problems in SmolLM2's chat template, up to {h['max_tokens']} tokens; "
           "every configuration runs on each prompt in turn, so machine noise hits them alike; decode tok/s excludes "
           f"prefill; T = {s['temperature']} uses top-k {s['top_k']}, top-p {s['top_p']}, min-p {s['min_p']}.", "",
           *_he_table(h), ""]
    m = {int(k.rsplit("_n", 1)[1]): R[k] for k in R if k.startswith("t0.7_match_n")}
    rj = {int(k.rsplit("_n", 1)[1]): R[k] for k in R if k.startswith("t0.7_rejection_n")}
    slow = [n for n in g if g[n]["speedup_vs_llama_cpp"] < 1.0]
    out += [f"n = {n_best} is the best greedy setting in this run: it decodes {gb['speedup_vs_llama_cpp']:.2f}× as "
            "fast as plain llama-cpp-python "
            f"({gb['tok_s']:.1f} vs {R['llama_cpp_greedy']['tok_s']:.1f} tok/s). Our loop without drafts is "
            f"{plain_ours['speedup_vs_llama_cpp']:.2f}× here, so drafting itself gives "
            f"{gb['tok_s'] / plain_ours['tok_s']:.2f}×: a step costs {gb['draft_ms_per_step']:.1f} ms of drafting and "
            f"{gb['verify_ms_per_step']:.1f} ms of verifying {n_best + 1} rows vs "
            f"{plain_ours['verify_ms_per_step']:.1f} ms per plain token "
            f"({gb['verify_ms_per_step'] / plain_ours['verify_ms_per_step']:.1f} plain tokens for {n_best + 1} rows), "
            f"and commits τ = {gb['tau']:.2f} tokens. "
            f"At T = {s['temperature']} and n = {n_best}, match verification runs "
            f"{m[n_best]['speedup_vs_llama_cpp']:.2f}× and rejection sampling "
            f"{rj[n_best]['speedup_vs_llama_cpp']:.2f}× "
            f"(τ {m[n_best]['tau']:.2f} / {rj[n_best]['tau']:.2f}). "
            + (f"Larger n raises τ ({' / '.join(format(g[n]['tau'], '.2f') for n in sorted(slow))}) but verifying "
               f"{min(slow) + 1}–{max(slow) + 1} rows costs "
               f"{_span([g[n]['verify_ms_per_step'] / plain_ours['verify_ms_per_step'] for n in slow], '.1f')} "
               f"plain tokens, so n = {' and '.join(str(n) for n in sorted(slow))} run slower than plain. "
               if slow else "")
            + f"τ at T = 0 is {_span([v['tau'] for v in g.values()])} (the goal was τ ≥ 3"
            + (": not reached)." if max(v["tau"] for v in g.values()) < 3 else ": reached)."), ""]
    div = h["divergences"]
    verdicts: dict[str, int] = {}
    for x in div:
        verdicts[x["verdict"]] = verdicts.get(x["verdict"], 0) + 1
    out += ["Greedy identity with llama-cpp-python, completions equal token for token: " +
            ", ".join(f"n = {k[1:]}: {v}" for k, v in h["greedy_identical_to_llama_cpp"].items()) + ". "
            f"Every divergent run ({len(div)}) was replayed (`llama_dflash.verify.certify`, as `llama-dflash diff` "
            "does): plain llama-cpp-python evaluates the same tokens one per `llama_decode` and in exactly the "
            "speculative run's verify batches. Verdicts: " + ", ".join(f"{k} {v}" for k, v in verdicts.items()) +
            " (\"batch-numerics\": in the speculative run's batches plain llama-cpp-python picks the speculative "
            "token itself — the target's kernels round differently for a batch, no DFlash code involved). Plain's "
            "logit gap between its token and ours at the first difference:", "",
            "| problem | n | position | gap, one token per decode | gap, in the speculative run's batches | "
            "verdict |", "|---|---|---|---|---|---|"]
    by: dict[tuple, list[int]] = {}
    for x in div:
        rp = x.get("replay") or {}
        key = (x["problem"], x["position"], rp.get("gap_one_by_one"), rp.get("gap_in_spec_batches"), x["verdict"])
        by.setdefault(key, []).append(x["n"])
    for (prob, pos, g1, g2, verdict), ns in by.items():
        out.append(f"| {prob} | {', '.join(map(str, ns))} | {pos} | {_gap(g1)} | {_gap(g2)} | {verdict} |")
    out += ["", "(`bench/check_batch_numerics.py` shows the same gap flips with plain chunks of 2 / 4 / 8.)", ""]
    return out


def humaneval_raw() -> list[str]:
    """bench_humaneval.py --format raw: the problems as raw completion prefixes."""
    if not (HERE / "humaneval_raw.json").is_file():
        return []
    h = _load("humaneval_raw.json")
    out = ["### As raw completion prompts", "",
            _source(h["command"], h["date"], "humaneval_raw.json", f" ({h['machine']})"),
            f"The first {h['problems']} problems' own prompts (signature and docstring) as raw completion prefixes, "
            f"tokenized as `create_completion` tokenizes them, up to {h['max_tokens']} tokens; otherwise as above.",
            "", *_he_table(h), ""]
    verdicts: dict[str, int] = {}
    for x in h["divergences"]:
        verdicts[x["verdict"]] = verdicts.get(x["verdict"], 0) + 1
    out += ["Greedy identity with llama-cpp-python: " + ", ".join(f"n = {k[1:]}: {v}" for k, v in
                                                                 h["greedy_identical_to_llama_cpp"].items())
            + f"; the {len(h['divergences'])} divergent runs replayed as above: "
            + (", ".join(f"{k} {v}" for k, v in verdicts.items()) or "none") + ".", ""]
    return out


def previous_drafter() -> list[str]:
    p, h = _load("humaneval_previous_drafter.json"), _load("humaneval.json")
    out = ["### The previous drafter on the same bench", "",
           _source(p["command"], p["date"], "humaneval_previous_drafter.json", f" ({p['machine']})"),
           "The drafter shipped before the current one (two commands, 570 k response tokens; the shipped one: one "
           "command, 906 k — every prompt with a greedy and a sampled response), on the same problems and settings; "
           "machine speed differs between the two runs, so compare τ and the ratios:", "",
           *_he_table(p), "",
           "| configuration | τ previous → shipped | vs llama-cpp-python, previous → shipped |", "|---|---|---|"]
    for k, r in h["results"].items():
        if "tau" not in r or k not in p["results"]:
            continue
        q = p["results"][k]
        out.append(f"| {_he_label(k)} | {q['tau']:.2f} → {r['tau']:.2f} | {q['speedup_vs_llama_cpp']:.2f}x → "
                   f"{r['speedup_vs_llama_cpp']:.2f}x |")
    return out + [""]


def drafters() -> list[str]:
    """drafters.json: two drafters on the same held-out HumanEval prompts, chat and raw completion."""
    if not (HERE / "drafters.json").is_file():
        return []
    r = _load("drafters.json")
    out = ["### Two drafters on HumanEval, chat and raw completion", "",
           _source(r["command"], r["date"], "drafters.json"),
           f"The first {r['problems']} HumanEval problems, greedy, up to {r['tokens']} tokens, in the chat template "
           "and as raw completion prompts (signature and docstring, tokenized as `create_completion` does); both "
           f"drafters on each prompt in turn. a = `{r['a']}`, b = `{r['b']}`. τ at T = 0 does not depend on the "
           "machine's speed; tok/s are comparable within the run only.", "",
           "| drafter | prompts | configuration | τ | tok/s | acceptance per position |", "|---|---|---|---|---|---|"]
    for key, v in r["rows"].items():
        who, fmt, conf = key.split("/")
        acc = ", ".join(f"{x:.2f}" for x in v["acceptance"] if x is not None)
        out.append(f"| {who} | {fmt} | {conf} | {v['tau']:.2f} | {v['tok_s']:.1f} | {acc} |")
    out.append("")
    return out


def heldout() -> list[str]:
    d = _load("heldout.json")
    out = ["### Held-out metrics of the training runs", "",
           _source(d["command"], d["date"], "heldout.json"),
           f"Each run's final drafter scored on the held-out sequences of `{d['on']}` ({d['held_out_sequences']}: "
           f"{d['greedy']} greedy, {d['sampled']} sampled), same anchors for all, each in its own draft vocabulary "
           "(metrics: docs/architecture.md §6.6):", "",
           "| run (stage) | draft vocab | per-slot accuracy | implied τ | block τ | DFlash2 path τ | selector accuracy "
           "| top-K recall | blocks |", "|---|---|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        acc = " ".join(f"{x:.3f}" for x in r["per_slot_accuracy"])
        sel = " ".join(f"{x:.3f}" for x in r.get("selector_accuracy", []))
        out.append(f"| `{r['run']}` ({r['stage']}) | {r['draft_vocab']} | {acc} | {r['implied_tau']:.3f} | "
                   f"{r['block_tau']:.3f} | {r.get('path_tau', float('nan')):.3f} | {sel} | "
                   f"{r.get('topk_recall', float('nan')):.3f} | {r['blocks']} |")
    res = d["results"]
    if len(res) == 2 and all("path_tau" in r for r in res):
        a_, b_ = res
        out += ["", f"Path τ `{b_['run']}` {b_['path_tau']:.2f} vs `{a_['run']}` {a_['path_tau']:.2f} "
                f"({100 * (b_['path_tau'] / a_['path_tau'] - 1):+.0f} %)."]
    if {r["run"] for r in res} == {"/work/runs/smollm2-mix2", "/work/runs/smollm2-big"}:
        out += ["", "(`/work/runs/smollm2-mix2` made the shipped drafter, `/work/runs/smollm2-big` the previous one; "
                "`python/llama_dflash/data/MODEL_CARD.md` lists these metrics for both.)"]
    return out + [""]


def _datasize_table(name: str, d: dict) -> list[str]:
    extra = f" ({d['recorded_from']})" if d.get("recorded_from") else ""
    out = [_source(d["command"], d["date"], name, extra),
           f"From `{d['init']}`, {d['tune_steps']} tuning steps (`--distill {d['distill']}`) on samples of "
           f"`{d['data']}`'s data; scored on {d['scored_sequences']} {d['scored_on']} sequences of that data (same "
           f"anchors for all) and on the first {d['problems']} HumanEval problems, greedy, {d['tokens']} tokens:", "",
           "| sequences | response tokens | block τ | DFlash2 path τ | HumanEval τ chat n = 3 / 7 | raw n = 3 / 7 |",
           "|---|---|---|---|---|---|"]

    def tau(he: dict, k: str) -> str:
        return f"{he[k]['tau']:.2f}" if k in he else "—"

    if d.get("start_held_out"):
        h = d["start_held_out"]
        out.append(f"| (the start) | | {h['block_tau']:.3f} | {h.get('path_tau', 0):.3f} | | |")
    for p in d["points"]:
        h, he = p["held_out"], p.get("humaneval", {})
        out.append(f"| {p['data'].get('train_sequences')} | {p['data'].get('response_tokens')} | "
                   f"{h['block_tau']:.3f} | {h.get('path_tau', 0):.3f} | "
                   f"{tau(he, 'chat/n=3')} / {tau(he, 'chat/n=7')} | {tau(he, 'raw/n=3')} / {tau(he, 'raw/n=7')} |")
    return out + [""]


def datasize() -> list[str]:
    """datasize*.json: one start and tuning budget on growing samples of one data set (a file per budget)."""
    runs = sorted(((f.name, _load(f.name)) for f in HERE.glob("datasize*.json")), key=lambda r: r[1]["tune_steps"])
    if not runs:
        return []
    out = ["### The data-size curve", ""]
    for name, d in runs:
        out += _datasize_table(name, d)
    return out


def train_smoke() -> list[str]:
    """train_smoke.json: `llama-dflash train --smoke` end to end, as a user runs it."""
    if not (HERE / "train_smoke.json").is_file():
        return []
    d = _load("train_smoke.json")
    stages = d["runs"][0]["stages_s"]
    return ["### `llama-dflash train --smoke`", "", _source(d["command"], d["date"], "train_smoke.json"),
            f"The whole pipeline on tiny settings, the CLI in a fresh process (Python start and imports included): "
            f"median {d['median_wall_s']:.1f} s over {len(d['runs'])} runs "
            f"({', '.join(str(r['wall_s']) for r in d['runs'])} s); the first run's stages (s): "
            + ", ".join(f"{k} {v}" for k, v in stages.items()) + ".", ""]


# ---------------------------------------------------------------------------------------------
# data.json / distill.json: the training data pipeline


def training_data() -> list[str]:
    out = ["## Training data", ""]
    if (HERE / "data.json").is_file():
        d = _load("data.json")
        if "speed" in d:
            sp = d["speed"]
            one, two = sp["one-pass"], sp["two-pass"]
            out += ["speed: " + _source(sp["command"], sp["date"], "data.json"), "",
                    f"{sp['sequences']} prompts × up to {sp['max_new']} tokens ({Path(sp['target']).name}, 8 sequences "
                    "per decode), interleaved chunk by chunk: one target pass (features and top-32 log-probabilities "
                    f"captured in the generating decodes) {one['s_per_sequence']:.2f} s per sequence "
                    f"({one['response_tok_s']:.0f} response tok/s), generation plus a second feature pass "
                    f"{two['s_per_sequence']:.2f} s ({two['response_tok_s']:.0f} tok/s): "
                    f"{sp['two_pass_over_one_pass']:.2f}×.", ""]
        if "nseq" in d:
            ns = d["nseq"]
            sizes = [k for k in ns if k.isdigit()]
            out += ["sequences per decode: " + _source(ns["command"], ns["date"], "data.json"), "",
                    f"{ns['sequences']} prompts × up to {ns['max_new']} tokens, one pass, the orders rotated chunk "
                    "by chunk: " + "; ".join(f"{k} sequences {ns[k]['s_per_sequence']:.3f} s per sequence "
                                             f"({ns[k]['speedup_over_8']:.2f}× over 8)" for k in sizes) + ".", ""]
        if "q8" in d:
            q = d["q8"]
            b = q["bytes_per_token"]
            out += ["q8: " + _source(q["command"], q["date"], "data.json"), "",
                    f"8-bit rows {b['q8']} B per token against fp16 {b['f16']} (both with the top-32 rows); their "
                    f"error {q['q8_error_rms_sd']} channel deviations RMS (max {q['q8_error_max_sd']}). The shipped "
                    f"drafter on {q['sequences']} held-out sequences ({q['blocks']} drafts of {q['draft_len']}): "
                    f"block τ {q['block_tau']['q8']:.3f} from q8 rows, {q['block_tau']['f16']:.3f} from fp16; "
                    f"{100 * q['same_drafts']:.0f} % of the drafts identical.", ""]
    if (HERE / "distill.json").is_file():
        d = _load("distill.json")
        out += ["distillation: " + _source(d["command"], d["date"], "distill.json"), "",
                f"{d['sequences']} sequences ({d['response_tokens']} response tokens, {d['held_out']} held out), "
                f"DFlash v1 {d['v1_steps']} steps then DFlash2 {d['v2_steps']} steps per arm, same seed and held-out "
                "anchors (a short recipe: it ranks the losses, it is not the shipped drafter's τ):", "",
                "| distill λ | block τ | path τ | first-slot accuracy | training s |", "|---|---|---|---|---|"]
        for lam, m in d["arms"].items():
            out.append(f"| {lam} | {m['block_tau']:.3f} | {m.get('path_tau', float('nan')):.3f} | "
                       f"{m['per_slot_accuracy'][0]:.3f} | {m['train_s']:.0f} |")
        out.append("")
    return out if len(out) > 2 else []


# ---------------------------------------------------------------------------------------------
# dropin.json: the drop-in class


def dropin() -> list[str]:
    d = _load("dropin.json")
    runs = d["runs"]

    def src(part: str) -> str:
        r = runs[part]
        return f"`{r['command']}`, recorded {r['date']}"

    out = ["## The drop-in class", "",
           f"`bench/results/dropin.json` (SmolLM2-135M-Instruct Q4_0 and the shipped drafter, {d['machine']}, "
           f"Python {d['python']}, llama-cpp-python {d['llama_cpp_python']}; each part records its own command and "
           "date).", "",
           f"Completion-loop overhead per token ({src('overhead')}) — both loops fed the same recorded tokens (no "
           "model work), with a stop string; llama-cpp-python re-detokenizes the whole completion after every token:",
           "", "| completion length | llama-cpp-python | ours | (stream: llama-cpp-python / ours) |",
           "|---|---|---|---|"]
    by = {(r["tokens"], r["stream"]): r for r in d["overhead"]}
    for n in sorted({r["tokens"] for r in d["overhead"]}):
        a, b = by[(n, False)], by[(n, True)]
        out.append(f"| {n} tokens | {a['llama_cpp_ms_per_token']:.2f} ms | {a['ours_ms_per_token']:.3f} ms | "
                   f"{b['llama_cpp_ms_per_token']:.2f} / {b['ours_ms_per_token']:.3f} ms |")
    m = d["memory"]
    out += ["", f"Peak RSS of a {m['ours']['tokens']}-token completion with `logprobs=5` at n_ctx 4096, a fresh "
            f"process each ({src('memory')}): llama-cpp-python (needs `logits_all=True`) "
            f"{m['plain']['peak_rss_mib']:.0f} MiB; ours (no `logits_all`) {m['ours']['peak_rss_mib']:.0f} MiB; "
            f"llama-cpp-python without logprobs {m['plain_no_logprobs']['peak_rss_mib']:.0f} MiB.", ""]
    if d.get("logprobs"):
        out += [f"Logprobs ({src('logprobs')}): ours, taken from the verify rows, against llama-cpp-python's "
                "(`logits_all=True`, one token per `llama_decode`) on the same greedy completions, next to how much "
                "llama-cpp-python differs from itself when it evaluates the same tokens in one batch (the target's "
                "batched kernels, not our arithmetic; the tests bound ours by plain's own deviation):", "",
                f"| logprobs, {len(d['logprobs'])} HumanEval chats, greedy | tokens | "
                "ours vs llama-cpp-python: max / median | llama-cpp-python in one batch vs itself: max / median |",
                "|---|---|---|---|"]
        for r in d["logprobs"]:
            out.append(f"| {r['problem']} | {r['tokens']} | {r['ours_vs_plain_max']:.4f} / "
                       f"{r['ours_vs_plain_median']:.4f} | {r['plain_batch_vs_plain_max']:.4f} / "
                       f"{r['plain_batch_vs_plain_median']:.4f} |")
        out.append("")
    gr = d["grammar"]
    rows_all = [r for rows in gr.values() for r in rows]
    kinds: dict[str, int] = {}
    for r in next(iter(gr.values())):
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    n_prompts = len(next(iter(gr.values())))
    out += [f"Grammar-aware drafting ({src('grammar')}): " +
            ", ".join(f"{v} {'JSON-schema chats' if k == 'json' else 'forced tool calls' if k == 'tool' else k}"
                      for k, v in kinds.items()) +
            f", greedy, up to {_opt(runs['grammar']['command'], '--max-tokens', '160 (the bench default)')} "
            "new tokens, "
            "prompt by prompt in one run; tok/s after the first token, means over the "
            f"{n_prompts} prompts (per prompt in the json). \"loop, no drafts\" is our loop with the drafter off: "
            "with a grammar at T = 0 it checks each row's raw argmax against the grammar first and runs llama.cpp's "
            "full-vocabulary grammar pass only when the grammar forbids it, which llama-cpp-python does for every "
            "token.", "",
            "| n | llama-cpp-python | ours, loop, no drafts | ours, grammar-aware drafts | ours, grammar-blind drafts "
            "| τ aware / blind | acceptance aware / blind |", "|---|---|---|---|---|---|---|"]

    def mean(rows, key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    for n, rows in gr.items():
        out.append(f"| {n} | {mean(rows, 'plain_tok_s'):.1f} | {mean(rows, 'loop_tok_s'):.1f} | "
                   f"{mean(rows, 'aware_tok_s'):.1f} | {mean(rows, 'blind_tok_s'):.1f} | "
                   f"{mean(rows, 'aware_tau'):.2f} / {mean(rows, 'blind_tau'):.2f} | "
                   f"{mean(rows, 'aware_acceptance'):.2f} / {mean(rows, 'blind_acceptance'):.2f} |")
    acc_ratio = [r["aware_acceptance"] / r["blind_acceptance"] for r in rows_all if r["blind_acceptance"] > 0]
    parts = []
    for n, rows in gr.items():
        loop = mean(rows, "loop_tok_s")
        parts.append(f"n = {n}: aware {mean(rows, 'aware_tok_s') / loop:.2f}× and blind "
                     f"{mean(rows, 'blind_tok_s') / loop:.2f}× the loop alone, aware "
                     f"{mean(rows, 'aware_tok_s') / mean(rows, 'plain_tok_s'):.2f}× llama-cpp-python; blind ahead of "
                     f"aware on {sum(r['blind_tok_s'] > r['aware_tok_s'] for r in rows)} of {len(rows)} prompts")
    longest = max(rows_all, key=lambda r: r["tokens"])
    lng = [r for r in rows_all if r["prompt"] == longest["prompt"]]
    runs_ = [r[f"{k}_divergence"] for r in rows_all for k in ("aware", "blind")]
    loop_same = sum(bool(r["loop_same_as_plain"]) for r in rows_all)
    certified = [x for x in runs_ if x and x.get("certified")]
    out += ["", f"Grammar-aware drafts are accepted {_span(acc_ratio, '.1f', '×')} as often as grammar-blind ones, "
            "prompt by prompt. " + "; ".join(parts) + ". "
            f"On the longest output (a {longest['tokens']}-token "
            f"{'tool call' if longest['kind'] == 'tool' else 'answer'}, "
            f"aware τ {' / '.join(format(r['aware_tau'], '.1f') for r in lng)} at n = "
            f"{' / '.join(n for n, rows in gr.items() for r in rows if r['prompt'] == longest['prompt'])}) aware "
            f"drafting runs {_span([r['aware_tok_s'] for r in lng], '.0f')} tok/s "
            f"({' / '.join(format(r['aware_tok_s'] / r['blind_tok_s'], '.2f') for r in lng)}× blind drafting) vs "
            f"{_span([r['loop_tok_s'] for r in lng], '.0f')} for the loop alone and "
            f"{_span([r['plain_tok_s'] for r in lng], '.0f')} for llama-cpp-python.", "",
            f"Outputs: the loop without drafts equals llama-cpp-python's in {loop_same} of {len(rows_all)} runs; "
            "of the "
            f"{len(runs_)} speculative runs, {sum(x is None for x in runs_)} equal it token for token, "
            f"{len(certified)} differ and are certified (plain llama-cpp-python, evaluating the speculative run's own "
            "verify batches — same positions and sizes — picks the speculative token too), and "
            f"{sum(1 for x in runs_ if x and not x.get('certified'))} are unexplained."
            + (f" Plain's gap flips from {_span([x['gap_one_by_one'] for x in certified], '+.3f')} "
               "one token per decode "
               f"to {_span([x['gap_in_spec_batches'] for x in certified], '+.3f')} in those batches: llama.cpp's batch "
               "numerics on this Q4_0 target, not the loop." if certified else ""), ""]
    return out


# ---------------------------------------------------------------------------------------------
# results without a json: kept verbatim, with their dates

BY_HAND = """\
## Measured by hand (no json in bench/results/)

These numbers were written down from runs whose json is not in `bench/results/`; they are kept
verbatim so that nothing measured is lost. They are not reproduced by this script.

- 2026-12-01, shortly before the saved `humaneval.json` run, same command, the shipped drafter:
  greedy n = 3 ran 1.14× plain llama-cpp-python (79.2 vs 69.6 tok/s); across that run and the
  saved one, T = 0.7 match verification ran 1.08–1.10× and rejection sampling 0.98–1.05×.
- 2026-12-01 01:14, the previous (two-command) drafter, same command: 1.21× at n = 3 greedy in an
  hour when this machine ran at 46 tok/s plain. That run's json was committed at the time and
  is still in git history: `git show ffad0ee:bench/results/humaneval.json`.
- Machine noise on this 2-core machine is ±10–15 % from run to run (observed across the runs
  above; the ratios inside one run are side by side and more reliable than absolute tok/s).

### Runs the README quoted (moved here on 2026-12-05)

The README quoted these runs until 2026-12-05. Their json files were overwritten by later runs of the
same benches (some are in git history at the commits named). This 2-core machine's speed varies
with the hour ("quiet", "medium", "middling", "slow"); in a slow hour a verify batch costs less
relative to one token, and drafting pays more.

**`llama-dflash demo`** (128 tokens, exact mode, adaptive; before the small-batch kernels of
2026-12-05). Its last lines on 2026-12-04 11:40 (a medium hour, with the shipped drafter, the
eighth run's, on a freshly set-up machine):

```
plain       (greedy): 128 tokens, 139.9 tok/s, tau 1.00, accepted 0/0, draft 0 ms, verify 903 ms, other 5 ms
speculative (greedy): 128 tokens, 161.0 tok/s, tau 1.81, accepted 57/77, draft 91 ms, verify 698 ms, other 1 ms
  adaptive: 29 of 70 steps plain, verified draft lengths {0: 43, 1: 3, 2: 10, 3: 11, 4: 0, 5: 0, 6: 0, 7: 3}, ...
speedup 1.15x (auto); ceiling 1.56x (the best draft lengths with this drafter at the measured costs), ...
greedy outputs bit-identical: yes (exact mode, self-check passed: verify batches of up to 8 rows are ...
```

(Three lines cut at "...": they ended "predicted 749 ms of draft + verify", "reached 27 % of its
gain" and "bit-identical)".) On 2026-12-04 14:02 (a fast hour, the same code) it printed plain
165.7 tok/s, speculative 181.7 (1.10×, τ 1.72), ceiling 1.51×, bit-identical. On 2026-12-03 22:28
(a middling hour) plain 140.6 tok/s, adaptive 1.18×, ceiling 1.66×. Earlier on 2026-12-03: 12:07
(a medium hour, the sixth run's drafter) 1.10× twice; 15:02 (a slow hour, the same drafter, two
runs) plain 100.5 / 104.7 tok/s, adaptive 1.25× / 1.24× (τ 2.05 / 1.95), ceiling 1.75× / 1.74×;
17:38 (a middling hour, the seventh run's drafter, two runs) plain 132.9 / 131.6 tok/s, adaptive
1.17× / 1.22×, ceiling 1.62×; bit-identical every time. One 128-token answer is short for the
adaptive default to learn where drafting pays (it starts from the cost model and calibration cached
by earlier runs, then probes).

**Cost-aware drafting, earlier runs** (`python3 bench/bench_adaptive.py --parts sets --problems 20
--prose 20 --tokens 128 --fixed 3,7 [--upstream]`; the results files as of the commits of those
days; tok/s relative to our plain loop, HumanEval greedy / prose greedy / HumanEval T 0.7 / prose
T 0.7; the runs before 2026-12-03 22:46 applied their ceilings to the fixed n = 7 run's token count,
which differs from the plain run's where an output ends elsewhere — the random drafter's and the
prose sets most, HumanEval greedy hardly):

| when (our plain loop, tok/s) | drafter run | adaptive (default) | fixed n = 3 | upstream n = 3, greedy | ceiling |
|---|---|---|---|---|---|
| 12-04 04:42, middling (120–124) | 8th | 1.29/1.05/1.13/1.00 | 1.34/0.87/1.12/0.74 | 1.09/0.83 | 1.74/1.29/1.51/1.18 |
| 12-03 14:25, slow (86–91) | 6th | 1.28/1.06/1.12/0.98 | 1.41/0.92/1.20/0.78 | 1.15/0.90 | 1.73/1.19/1.50/1.15 |
| 12-03 11:34, medium (132–151) | 6th | 1.15/1.01/1.02/1.01 | 1.15/0.70/0.97/0.64 | 1.05/0.71 | 1.39/1.13/1.22/1.06 |
| 12-03 08:30, slow (104–113) | 6th | 1.25/0.99/1.11/1.00 | 1.29/0.84/1.10/0.75 | 1.21/0.88 | 1.62/1.28/1.37/1.16 |
| 12-03 04:58, quiet (187–189) | 5th | 1.05/1.01/1.06/1.00 | 1.02/0.67/1.05/0.67 | 1.00/0.71 | 1.33/1.11/1.33/1.08 |
| 12-03 00:20, quiet (187–209) | 4th | 1.08/1.00/0.98/0.98 | 1.06/0.64/0.82/0.56 | 0.98/0.71 | 1.37/1.09/1.10/1.03 |
| 12-02 18:08, slow (99–103) | 3rd | 1.18/1.03/1.12/0.99 | 1.33/0.85/1.11/0.75 |  | 1.62/1.27/1.43/1.15 |
| 12-02 15:14, slow (107–112) | 2nd | 1.14/1.04/1.05/0.99 | 1.19/0.83/1.03/0.72 |  | 1.53/1.25/1.34/1.13 |
| 12-02 12:38, quiet (155–187) | 1st | 0.99/1.02/1.03/0.99 | 0.88/0.64/0.79/0.57 | 0.84/0.66 | 1.26/1.09/1.17/1.03 |

In a quiet hour a verify batch is compute-bound (2 rows cost 1.7 one-row steps, 4 rows 2.1, 8 rows
3.5 at 04:58) and fixed-length drafting loses; in a slow one a verify row costs less relative to a
one-row step (a verify of 2 / 4 / 8 rows 1.49 / 1.71 / 2.69 one-row steps at 08:30). The runs differ
in the hour as well as the drafter, so they are not an A/B of the drafters (`bench/bench_drafters.py`
is). Smaller runs (12 + 12 prompts, 96 tokens) spread by about ±10 % prompt to prompt. The README
also said: in a quiet hour the shipped drafter ran 1.01–1.05× plain speed on the four sets
(2026-12-04 10:50); a useless drafter cost 0–3 % (5 % in the quiet run before probes stopped being
drafts made whole).

**Against upstream llama.cpp's own DFlash loop** (`llama-speculative-simple`, the same two files,
built from the same llama.cpp with the same CPU flags), at the same draft length our loop ran
1.23× / 1.30× upstream's on HumanEval (n = 3 / 7) and 1.05× / 1.08× on prose on 2026-12-04 04:42;
1.13× / 1.34× and 1.05× / 1.08× on 2026-12-03 22:47; 1.02× / 1.10× and 0.95× / 0.98× in the quiet
hour of 2026-12-03 04:58.

**In exact mode, earlier runs** (the same bench with `--exact`, the sixth run's drafter; tok/s
relative to our exact plain loop): 2026-12-03 14:01 (a slow hour, plain 106–121 tok/s;
`bench/results/adaptive_exact.json` at commit 65c37f4) adaptive 1.17 / 1.06 / 1.07 / 1.02, fixed
n = 3 1.20 / 0.84 / 1.02 / 0.77, ceiling 1.58 / 1.25 / 1.38 / 1.16, a random drafter 0.997; 11:51
(a medium hour, plain 147–179 tok/s) adaptive 0.96 / 0.97 / 0.98 / 0.99, fixed n = 3 0.95 / 0.65 /
0.88 / 0.61.

**A drafter step in the loop's shape** before DFlash2's convolution was fused (2026-12-04 03:29,
`bench_core --only inloop`): the shipped drafter's step took 0.51–0.58 (n = 3) and 0.46–0.53 (n = 7)
of upstream's time.

**Bigger targets, replayed drafts** (`bench_adaptive.py --parts replay`): in the 2026-12-04 13:40
run above a second verify row cost 1.15 / 1.06 one-row steps on Qwen / Gemma; on Qwen at p = 0.9 the
policy's steps committed 3.6 tokens each, fixed n = 6's 6.1: by the cost model at the end of the
run 4-row steps commit more per second than 7-row ones, and the two fixed runs measured the other
way. In a slow hour (2026-12-02 18:32, exact mode's settings of then, Qwen plain 12.0 tok/s, a
second row costing 0.52 one-row steps) the same bench gave adaptive 0.97 / 1.03 / 1.23 / 1.92× on
Qwen2.5-Coder-1.5B and 1.05 / 1.27 / 1.69 / 2.25× on Gemma-3-270M at p = 0.3 / 0.5 / 0.7 / 0.9.

**What a length policy can reach, earlier runs** (`python3 bench/bench_policy.py`; HumanEval greedy
/ prose greedy / HumanEval T 0.7 / prose T 0.7):

- 2026-12-04 03:11–03:17 (the shipped drafter; a slow hour, plain 92–109 tok/s): the oracle 1.68 /
  1.25 / 1.55 / 1.17× (from 2026-12-04 the ceiling may verify more rows than it commits where a
  larger batch costs less: the CPU's 4-row tiles make 4 rows cheaper than 3); the best simple causal
  rule per set 1.29 / 1.04 / 1.17 / 1.00×; the best gate on what the last step showed, its table
  fitted on the same traces, 1.30 / 1.00 / 1.19 / 1.00×; the engine's policy replayed 1.30 / 1.05 /
  1.18 / 0.99× and measured 1.32 / 1.07 / 1.14 / 1.01×: 47 % of the oracle's gain on HumanEval
  greedy, short of the 60 % the cost-aware-drafting issue sets. With free drafts the best causal
  rule would give 1.55 / 1.17 / 1.43 / 1.07×. The engine's policy replayed within about 1 % of
  every causal policy fitted on its own traces (0.5 % on HumanEval greedy). A draft (~50 M
  multiply-adds at n = 3) took 2.2–2.5 ms after a target decode, against ~11 ms for a target token
  that hour.
- The sixth run's drafter (2026-12-03 09:04, `bench/results/policy.json` of commit 1d7b6e4, the old
  ceiling): oracle 1.63 / 1.24 / 1.52 / 1.15×, replayed 1.24 / 1.03 / 1.14 / 0.99×, measured 1.10 /
  1.03 / 1.01 / 0.99×.
- The fifth run's, in a quiet hour (2026-12-03 05:11, as of commit ef1e49b): oracle 1.45 / 1.16 /
  1.35 / 1.09×, replayed 1.08 / 1.03 / 1.00 / 0.99×, measured 1.02 / 1.01 / 0.98 / 1.01×.
- The previous shipped drafter (q4_0, replaced later that day), 2026-12-02 13:55 (20 HumanEval + 20
  prose prompts, greedy and T = 0.7, 128 tokens; a slow hour, plain 111–116 tok/s against 185–204
  in a quiet one; a second verify row 1.48 one-row steps, 4 rows 1.73, 8 rows 2.75; a draft
  0.15–0.3): an oracle that knows each draft's acceptance before drafting 1.49× / 1.24×
  (HumanEval / prose, greedy) and 1.43× / 1.14× (T = 0.7); the best policy of a family that learns
  acceptance only from its own drafts, its parameters picked per set on the same traces, 1.15× /
  1.04× and 1.10× / 0.99× (1.29× / 1.14× and 1.25× / 1.05× with drafts that cost nothing); the
  engine's policy replayed 1.08× / 1.04× and 1.06× / 0.99×, measured against our plain loop 1.09× /
  1.05× and 1.02× / 0.99× — 18 % / 20 % of the oracle's gain at T = 0. On traces of 13:43 (12 + 12
  prompts, greedy) under the 12:26 run's costs the same policy replays 1.01× / 1.06× (HumanEval /
  prose) where the replay before that day's 13:50 fix said 0.99× / 1.04× (docs/architecture.md
  §5.9, "Replay").
- The q8_0 original, 2026-12-02 08:04 (`bench/results/policy.json` of commit b306122): oracle
  1.32× / 1.16× and 1.25× / 1.07×, best causal 1.02× / 1.03× and 1.02× / 0.98×. Cheaper drafts
  moved the causal policies only a little: the confidence signal, not the draft's cost, keeps them
  far from the oracle.

**Small-batch kernels, an earlier run** of `python3 bench/bench_kernels.py` (2026-12-05
02:08–02:17): exact mode with the kernels (adaptive) 1.68× / 1.52× llama-cpp-python on HumanEval /
prose, llama.cpp's kernels in the same loop 1.43× / 1.18×.

**Small-batch kernels after that day's changes** (per-superblock unpacking, the stream prefetch,
the AVX2 repacked kernels taking 8 rows at once, Q5_0 taken: docs/architecture.md §13). One-row
decode on 1 thread (2026-12-05 03:50, others' test suite running: load 3–4; min of 20, two
interleaved rounds, processes alternating; no json), ours now / ours before / llama.cpp:
Qwen2.5-Coder-1.5B Q4_K_M 104.5–112.1 / 170.3–173.6 / 134.0–135.4 ms; Gemma-3-270M Q4_K_M
29.1–29.3 / 34.9–35.4 / 36.2–37.2 ms; SmolLM2-135M Q4_0 10.7–11.4 / 11.6–12.3 / 14.8–14.9 ms.
Forcing the AVX2 kernels: 116–117 / 270–274 ms on Qwen2.5 (llama.cpp's AVX512 build 133–166), and
k-row batches got faster too (1 thread, Qwen2.5 k = 4 / 8 / 16 on AVX2: 154 / 288 / 558 ms, before
999 / 1708 / 2450). Gemma-3 now gives the kernels all 127 products of a one-row decode (before: 46,
its 81 Q5_0 ones stayed with ggml). The "Small-batch kernels" section above (2026-12-05 02:17)
predates these changes; "The verify curve, measured again" below is the later run.

**The kernels' own attention** (2026-12-05 13:00, docs/architecture.md §13). Interleaved A/B of the
package before and after it (SmolLM2-135M Q4_0, 2 threads, flash attention on, best of 15, three
rounds, processes alternating; no json): after 64 positions t(1) / t(4) / t(8) 6.46–6.90 /
9.55–9.81 / 14.80–14.99 ms before, 6.42–6.79 / 8.63–9.25 / 13.53–14.08 after; after 448 positions
8.90–9.08 / 15.88–16.06 / 25.57–26.15 before, 7.74–8.79 / 10.94–11.42 / 15.75–16.42 after.
`llama-dflash demo` (13:09–13:12, load 0.4–1.3, four runs): 1.39×, 1.35×, 1.31×, 1.41× over our
own exact plain loop, ceiling 1.91–1.94× (1.37× / 1.26× / 1.47× and ceiling ~1.5× at 10:36, before
it), bit-identical every time; fixed drafts on the same prompt (13:13, two rounds) 1.25–1.37× (3),
1.19–1.25× (5), 1.04–1.19× (7), adaptive 1.37× both times. Exact mode's self-check (16 rows probed,
the 300-position probe included) passes at 16 of 16 rows on SmolLM2-135M Q4_0, Gemma-3-270M and
Qwen2.5-Coder-1.5B Q4_K_M, with the AVX512 kernels and with the AVX2 build (13:26). The same
decodes repeated back to back (no ggml context between them, the weights partly L3-resident) ran
faster at 13:27: SmolLM2 t(1) 4.8–6.7 ms, t(4)/t(1) 1.16–1.53, t(8)/t(1) 1.85–2.43; the curve above
alternates with ggml's context and is the comparable measurement. With the row-wise ops taken too
(commit 2831cbf), `llama-dflash demo` at 14:17 (four runs, load 0.4 before): 1.34×, 1.31×, 1.51×,
1.45× (mean 1.40×), plain 137–156 tok/s, speculative 200–207 tok/s, ceiling 2.10–2.12×,
bit-identical every time. With RoPE, the KV writes and SwiGLU inside our split too (commit c4f5326;
a fast hour, 15:51–15:58, load 0.6): four runs 1.20×, 1.26×, 1.28×, 1.23× (plain 180 tok/s,
speculative 221 tok/s, ceiling 1.87×), then interleaved with the commit before it: 1.19× / 1.17× /
1.44× against 1.13× / 1.29× / 1.33× (plain 166–196 and 173–184 tok/s), bit-identical every time: a
faster one-token decode (memory-bound) raises t(k)/t(1), so the policy drafts shorter (verified
lengths mostly 0–1) and the ceiling falls (1.88× against 2.03× at the older commit's costs). The demo
then ran plain and speculative twice each, alternating, and reports each side's faster run (one run
each swung 1.13–1.44× within minutes): at 16:19 (a slower hour, plain 145–153 tok/s) four runs gave
1.37×, 1.38×, 1.38×, 1.38× (τ 2.31–2.35, ceiling 1.95–1.97×), bit-identical every time. The
end-to-end set again with that code (16:40, `bench_kernels.py --parts e2e --problems 6 --prose 6`, not
saved over the 14:17 file): exact adaptive 2.65× / 2.05× llama-cpp-python on HumanEval / prose, 1.52× /
1.11× our own exact plain loop, 6/6 and 6/6 identical; fixed n = 3 in exact mode 1.61× / 1.03×: on
HumanEval, where the drafter is accepted most, the adaptive policy drafts longer (τ 2.96 against 2.78)
and ends 5–6 % behind a fixed n = 3 (at 14:17 too: 1.65× against 1.74×), while it is ahead on prose.

**Q8_0 eight rows at a time** (commit 900f853, docs/architecture.md §13; 2026-12-05 17:40–17:55).
SmolLM2's head (Q8_0, 49152 × 576) was a sixth of a 4-row verify and ran at ~94 G MAC/s at 8 rows:
its blocks are now transposed in registers so that one `vpdpbusd` serves 8 weight rows. The head
alone, 2 threads, 1 / 4 / 8 rows: 0.63 / 1.37 / 2.75 → 0.62 / 0.79 / 1.22 ms. SmolLM2 Q4_0 decodes
interleaved with the commit before (4 rounds, best of 40): t(4) 8.2–8.6 → 7.1–7.9 ms, t(8) 12.4–13.2 →
9.6–10.6, t(1) 5.8–6.4 → 5.7–6.9 (unchanged). The verify curve above is the run after it (17:48):
SmolLM2 Q4_0 t(4)/t(1) 1.22 and t(8)/t(1) 1.61 (16:14: 1.32 / 2.02), Q8_0 1.17 / 1.46, Gemma-3 1.26 /
1.68, Qwen2.5-Coder-1.5B (a Q6_K head, unchanged) 1.22 / 1.72. `llama-dflash demo`, interleaved with
the commit before (17:47, a fast hour, plain 157–177 tok/s): 1.46×, 1.53×, 1.50×, 1.53× against
1.38×, 1.45×, 1.30×, 1.30× (τ 2.40–2.59 against 2.27–2.40: cheaper rows, longer drafts), bit-identical
every time. The end-to-end set above is the run after it (17:52): exact adaptive 3.12× / 2.15×
llama-cpp-python on HumanEval / prose, 1.75× / 1.17× our own exact plain loop, and adaptive now
level with a fixed n = 3 on HumanEval (288.7 against 288.4 tok/s) and ahead on prose.
Tried for the adaptive policy's 5–6 % behind n = 3 before this commit, and dropped: pricing the draft
length's time at the rate the cut values slots at (the rate achieved) instead of plain decoding's.
Replayed on dense traces (12 HumanEval + 12 prose prompts, 17:35) it moved the engine from 1.526 /
1.141× to 1.529 / 1.151×, but the demo, interleaved (5 rounds, 17:39), ran 1.40 / 1.34 / 1.42 / 1.35 /
1.33× against the old sizing's 1.37 / 1.41 / 1.50 / 1.49 / 1.55× (τ 2.12–2.19 against 2.23–2.44):
shorter drafts lost more than their draft time saved. Charging the gate's gain at that rate too
replayed worse (1.503× on HumanEval).
`bench_adaptive.py --exact --upstream` with the kernels (18:11, "With the small-batch kernels" under
Cost-aware drafting): exact adaptive 2.80× llama-cpp-python on HumanEval greedy (247.9 against 88.5
tok/s; 1.67× our plain loop, fixed n = 3 1.74×, the ceiling 2.41×), 1.41× our plain at T = 0.7, 1.15×
on prose greedy; upstream's own loop 110.5 tok/s (n = 3). Until this run the bench's llama-cpp-python
arms ran on our kernels (importing llama-dflash registers them for every context: 118.3 tok/s in a
first attempt of the same run); they now switch them off. Prose at T = 0.7 ran 0.936× plain (fixed n
= 3 0.943×; before the kernels 0.96–1.03×): drafting there gains nothing (τ 1.17) and the policy,
which had just drafted through HumanEval at T = 0.7, kept drafting in 351 of 803 steps. The same 8
prose prompts alone, plain and adaptive interleaved (18:25, two processes each with the cached
calibration and with an empty one): 0.991× / 1.004× and 0.978× / 0.999×, 594–634 of ~855 steps plain.
The AVX2 build's verify curve after the Q8_0 group kernel (18:05; the roofline's AVX2 peak measured
since) and again after AVX2 Q4_0's lane pairs are summed before the float step (18:45, the curve under
"The verify curve with AVX2 code only" is this run; load 1.7 before): SmolLM2 Q4_0 t(4)/t(1) 1.42 → 1.37, t(8)/t(1)
2.07 → 2.01 (13:21: 1.48 / 2.48); Gemma-3 1.36 / 2.16 → 1.34 / 2.13; Qwen2.5-Coder-1.5B 1.29 / 2.01 →
1.28 / 1.95. One row 0.63–0.83× llama.cpp's AVX2 build, prefill within 2.4 %.
"""


# ---------------------------------------------------------------------------------------------
# exact.json: batch invariance of every quantization type, the cost of exact mode, identity counts


def exact() -> list[str]:
    if not (HERE / "exact.json").is_file():
        return []
    r = _load("exact.json")
    runs = r["runs"]
    out = ["## Exact mode", "", *[f"{part}: " + _source(v["command"], v["date"], "exact.json") for part, v in
                                  runs.items()], "",
           f"Exact mode's settings: `{json.dumps(r['exact_settings'])}` (model `use_extra_bufts`: llama.cpp's "
           "repacked CPU weights or the plain layout, whichever stays invariant longer, as `core.exact.weight_layout` "
           "picks; context flash attention; ggml's reference CPU kernels on the context, since 2026-12-03). "
           "A size is invariant when a verify batch of that many rows, and the two one-token decodes "
           "after it, give bit-identical logits to decoding the same tokens one by one (the self-check's probe); "
           "\"64\" is a 64-row prefill (the same batch in plain and speculative runs, so not needed for identity).",
           ""]
    names = list(r["exact_settings"])
    shown = {"exact": "exact, plain layout"}  # (the key the runs before 2026-12-03 stored it under)
    inv = r.get("invariance")
    if inv:
        def run(d: dict) -> str:
            ok = [k for k, v in d.items() if v == 0.0]
            k = 1
            while str(k + 1) in d and d[str(k + 1)] == 0.0:
                k += 1
            extra = sorted(set(ok) - {str(i) for i in range(2, k + 1)}, key=int)
            return (f"2–{k}" if k > 2 else "2" if k == 2 else "none") + (f" (also {', '.join(extra)})" if extra else "")

        def longest(d: dict) -> int:
            k = 1
            while str(k + 1) in d and d[str(k + 1)] == 0.0 and k + 1 <= 16:
                k += 1
            return k
        out += ["| SmolLM2-135M as | default settings | " + " | ".join(shown.get(n, n) for n in names) +
                " | exact mode's layout: drafts up to |", "|---" * (3 + len(names)) + "|"]
        for t, d in inv.items():
            rep, plain = longest(d.get("exact, repacked", {})), longest(d.get("exact", {}))
            pick = "exact, repacked" if rep >= plain else "exact"
            k = longest(d.get(pick, {}))
            out.append(f"| {t} | {run(d['default'])} | " + " | ".join(run(d[n]) if n in d else "—" for n in names) +
                       f" | {k - 1 if k >= 2 else 'refused'} ({'repacked' if pick != 'exact' else 'plain layout'}) |")
        out += ["", "Cells: the batch sizes (rows) that are invariant.", ""]
    cost = r.get("cost_ms")
    if cost:
        out += ["| target | rows | default ms | " + " | ".join(f"{shown.get(n, n)} ms" for n in names) + " | " +
                " | ".join(f"{shown.get(n, n)} / default" for n in names) + " |", "|---" * (3 + 2 * len(names)) + "|"]
        for label, c in cost.items():
            for k in c["default"]:
                out.append(f"| {label} | {k} | {c['default'][k]:.1f} | " +
                           " | ".join(f"{c[n][k]:.1f}" for n in names) + " | " +
                           " | ".join(f"{c[f'{n} over default'][k]:.2f}" for n in names) + " |")
        out += ["", "Medians of interleaved rounds (3 timings each, after a 32-token prefix; all settings loaded "
                "side by side).", ""]
    lay = r.get("layout")
    if lay:
        out += ["Exact mode end to end in either weight layout (mixed prompts, 128 tokens, greedy, the shipped "
                "drafter; interleaved prompt by prompt; tok/s of the decode phase):", "",
                "| target | layout | plain tok/s | fixed n = 3 | adaptive | fixed n = 3 / plain | adaptive / plain "
                "| τ n = 3 / adaptive | identical to plain |", "|---|---|---|---|---|---|---|---|---|"]
        for label, d in lay.items():
            for name in ("repacked", "plain layout"):
                x = d[name]
                out.append(f"| {label} | {name} | {x['plain_tok_s']:.1f} | {x['fixed_n3_tok_s']:.1f} | "
                           f"{x['auto_tok_s']:.1f} | {x['fixed_n3_x']:.2f}× | {x['auto_x']:.2f}× | "
                           f"{x['tau']['fixed_n3']:.2f} / {x['tau']['auto']:.2f} | {x['identical_to_plain']} |")
            q = d["repacked_over_plain_layout"]
            out.append(f"| {label} | repacked / plain layout | {q['plain']:.2f}× | {q['fixed_n3']:.2f}× | "
                       f"{q['auto']:.2f}× | | | | |")
        out.append("")
    ident = r.get("identity")
    if ident:
        st = r["identity_settings"]
        layout = r.get("identity_layout", "the settings before 2026-12-03 (the plain layout, no reference kernels; "
                                          "every run under 256 positions, where those were exact)")
        out += [f"Speculative vs plain, token for token: {st['prompts']} prompts × (greedy + {st['seeds']} seeds at "
                f"T = 0.8), {st['max_tokens']} tokens each; exact mode with {layout}.", "",
                "| target / mode / drafter | " + " | ".join(f"n = {n}" for n in ("1", "3", "7", "15")) + " |",
                "|---|---|---|---|---|"]
        for key, counts in ident.items():
            partial = r.get("identity_blocks", {}).get(key, {}).get("partial")
            cells = [f"{counts[n]['identical']} / {counts[n]['runs']}" if n in counts else
                     ("not measured yet" if partial else "— (capped)") for n in ("1", "3", "7", "15")]
            extra = [n for n in counts if n not in ("1", "3", "7", "15")]
            if extra:  # the self-check capped n_max below 15: the longest length it allows
                cells[-1] = f"n = {extra[0]}: {counts[extra[0]]['identical']} / {counts[extra[0]]['runs']}"
            out.append(f"| {key}{' (partial)' if partial else ''} | " + " | ".join(cells) + " |")
        out.append("")
    return out


# ---------------------------------------------------------------------------------------------
# adaptive.json: cost-aware drafting against fixed lengths, the peers and the ceiling

_ADAPTIVE_LABELS = {"lcpp_plain": "llama-cpp-python plain", "lcpp_prompt_lookup": "llama-cpp-python prompt lookup",
                    "lcpp_plain_same_settings": "llama-cpp-python plain, exact mode's settings (flash attention, "
                                                "same weight layout: the same tokens as ours)",
                    "ours_plain": "ours plain", "auto": "**ours adaptive** (`speculation=\"auto\"`)",
                    "oracle": "ceiling (oracle lengths, cost-model times)"}


def _label(k: str) -> str:
    if k.startswith("upstream_dflash_n"):
        return f"upstream llama.cpp's DFlash loop (llama-speculative-simple), n = {k[len('upstream_dflash_n'):]}"
    return _ADAPTIVE_LABELS.get(k, k.replace("fixed_n", "ours fixed n = "))


def _adaptive_sets(r: dict, json_name: str) -> list[str]:
    out = [_source(r["command"], r["date"], json_name,
                   f"; {r['tokens']} tokens per prompt, 2 threads, {r['target']} + {r['drafter']}"), "",
           "Every configuration interleaved prompt by prompt in one run. Decode tok/s (prefill excluded); "
           "\"vs ours plain\" is the ratio of total tok/s, \"worst prompt\" the lowest per-prompt ratio. "
           "The ceiling commits exactly what a run at n_max got accepted (drafting and verifying that, or more "
           "where a larger batch costs less: the CPU's 4-row tiles), its steps priced by the cost model "
           "against plain steps over the same tokens priced the same way, a ratio applied to our measured plain "
           "speed and the plain run's tokens (no loop overhead): the best any length policy can do with this "
           "drafter here (results dated before 2026-12-03T14:00 set the modelled oracle time against the "
           "measured plain time instead, which moved the ceiling with the one-row model's error; results dated "
           "before 2026-12-03T22:46 took the n_max run's token count, which differs where its output ends "
           "elsewhere: a random drafter's set showed 0.94; results dated before 2026-12-04 price each step at exactly "
           "its accepted rows, not the cheapest batch of at least those). "
           "\"gain captured\" = (adaptive − plain) / (ceiling − plain).", ""]
    for name, rows in r["sets"].items():
        out += [f"**{name}**", "", "| configuration | tok/s | vs ours plain | worst prompt | τ | notes |",
                "|---|---|---|---|---|---|"]
        for k, v in rows.items():
            notes = []
            if "vs_llama_cpp" in v:
                notes.append(f"{v['vs_llama_cpp']:.2f}× llama-cpp-python")
            if v.get("plain_steps") is not None and "lengths" in v:
                notes.append(f"{v['plain_steps']} of {v['steps']} steps plain; verified lengths {v['lengths']}")
            if v.get("predicted_over_measured"):
                notes.append(f"predicted / measured step time {v['predicted_over_measured']:.3f}")
            if v.get("fraction_of_ceiling_gain") is not None:
                notes.append(f"gain captured {v['fraction_of_ceiling_gain']:.2f}")
            out.append(f"| {_label(k)} | {v['tok_s']:.1f} | {v.get('vs_ours_plain', 1.0):.3f} | "
                       f"{v.get('per_prompt_min', 1.0):.3f} | {v.get('tau', '')} | {'; '.join(notes)} |")
        out.append("")
    if r.get("cost_model_ms"):
        out += [f"Cost model at the end of the run (ms): verify batches of 1 … n rows "
                f"{r['cost_model_ms']['t_verify']}, drafts of 1 … n tokens {r['cost_model_ms']['t_draft']}.", ""]
    return out


def adaptive() -> list[str]:
    if not (HERE / "adaptive.json").is_file():
        reach = policy_reach()
        return ["## Cost-aware drafting", "", *reach] if reach else []
    r = _load("adaptive.json")
    out = ["## Cost-aware drafting", ""]
    if r.get("sets"):
        out += _adaptive_sets(r, "adaptive.json")
    # (other runs of the bench: file, heading, what sets it apart)
    for name, title, intro in (
            ("adaptive_kernels.json", "With the small-batch kernels, in exact mode (the defaults since 2026-12-05)",
             "Our loop in exact mode with our kernels (docs/architecture.md §13), every adaptive output checked "
             "identical to our plain one and our plain greedy output to llama-cpp-python's under the same settings "
             "(which, in a process that imported llama-dflash, runs our kernels too); llama-cpp-python plain and "
             "its prompt lookup at their defaults with our kernels switched off, as it runs without llama-dflash; "
             "upstream's loop as below. The results above and below predate the kernels."),
            ("adaptive_upstream.json", "Against upstream llama.cpp's own DFlash loop",
             "The same two files through upstream's `llama-speculative-simple --spec-type draft-dflash` (built "
             "from the llama.cpp our libllama is, same CPU flags: `bench/build-upstream.sh`), greedy, its own "
             "decode speed and acceptance from its log (τ from its drafted / accepted counts), interleaved "
             "with every other configuration prompt by prompt."),
            ("adaptive_earlier.json", "The same bench, the same code, an hour and a half earlier",
             "The same command on the same code (the policy, the fused DFlash2 convolution) in a slower hour "
             "(our plain loop 122-139 tok/s against 134-143 above): how far one run of this bench moves from "
             "the next."),
            ("adaptive_exact.json", "In exact mode",
             "Our loop in exact mode (flash attention, the weight layout it picks, reference CPU kernels; every "
             "adaptive output checked identical to our plain one, and our plain greedy output to "
             "llama-cpp-python's under the same settings), against "
             "llama-cpp-python at its defaults and under exact mode's settings.")):
        if (HERE / name).is_file():
            out += [f"### {title}", "", intro, "", *_adaptive_sets(_load(name), name)]
    out += policy_reach()
    rp = r.get("replay")
    if rp:
        out += ["### Bigger targets, replayed drafts at a fixed acceptance", "",
                _source(rp["command"], rp["date"], "adaptive.json", f"; {rp['tokens']} tokens, 2 prompts"), "",
                "A draft source that replays the plain output with each slot right with probability p (while the "
                "ones before it were): where speculation pays on these targets, and how close the cost model's "
                "predicted draft + verify time comes to the measured one.", ""]
        longest = 6 if rp.get("exact") else 7
        if rp.get("exact"):
            out += ["Exact mode (plain and every speculative run bit-identical, checked): in the default mode a near "
                    "tie rounded apart by a verify batch leaves the source replaying another text, every draft "
                    "rejected from there on. Its self-check verifies at most 7 rows on these K-quant targets, so "
                    "the longest fixed length is 6.", ""]
        out += [f"| target | p | fixed n = 3 | fixed n = {longest} | adaptive | adaptive: plain steps | "
                "predicted / measured |", "|---|---|---|---|---|---|---|"]
        for label, rows in rp["targets"].items():
            ps = sorted({k.split("/")[0] for k in rows if "/" in k})  # the acceptance levels, "p0.3" ...
            for pk in ps:
                f3, f7, au = (rows.get(f"{pk}/fixed_n3", {}), rows.get(f"{pk}/fixed_n{longest}", {}),
                              rows[f"{pk}/auto"])
                out.append(f"| {label} | {pk[1:]} | {f3.get('vs_plain', 0):.2f}× | {f7.get('vs_plain', 0):.2f}× | "
                           f"{au['vs_plain']:.2f}× | {au['plain_steps']} / {au['steps']} | "
                           f"{au['predicted_over_measured']:.3f} |")
            out.append(f"| {label} | plain | {rows['plain']['tok_s']:.1f} tok/s | | | | |")
        out.append("")
    return out


def policy_reach() -> list[str]:
    if not (HERE / "policy.json").is_file():
        return []
    r = _load("policy.json")
    cm = r["cost_model_ms"]
    out = ["### What a length policy can reach: dense traces", "",
           _source(r["command"], r["date"], "policy.json", f"; {r['tokens']} tokens per prompt, "
                   + ("greedy and T = 0.7 (match verification, seeded), " if any(k.endswith("_t0.7") for k in r["sets"])
                      else "greedy, ") + f"{r['target']} + {r['drafter']}"), "",
           "For every position of each prompt's plain output, the drafter's n_max-token draft from there and "
           "how much of it the output continues with; any length policy's steps and their cost-model time follow "
           "from these traces exactly. The oracle (dynamic programming over positions) knows every draft's "
           "acceptance before drafting; a causal policy knows only what its own drafts showed. \"best causal\" "
           "is the best of a family (draft n every step, or only while the last draft got ≥ A accepted with a "
           "probe every P plain steps; each draft cut by calibrated confidence, the calibration fitted on the same "
           "traces); \"engine, replayed\" runs the engine's own policy functions (csrc/dflash_policy.c) step by "
           "step on the traces; \"free drafts\" is the causal family with t_draft = 0 (what the confidence "
           "signal is worth by itself); \"best gate\" drafts (n tokens, cut by confidence) or steps plainly by "
           "what the last step showed -- the engine's four states, or those with the rejection's place and, after "
           "a step that accepted all it verified, whether the draft's next slot matched the target's next token "
           "-- its table fitted on the same traces (optimistic for it; it has no probes: where drafting after a plain "
           "step does not pay on the whole it never drafts again). The oracle may "
           "verify more rows than it commits where a larger batch costs less. "
           "At T = 0.7 match verification keeps a draft while it equals the seeded "
           "sample, and the samples are plain decoding's, so the sampled output is traced like the greedy one. "
           "\"measured\" is our adaptive loop against our plain loop, timed in the "
           "same run, interleaved prompt by prompt. Gains are over plain decoding. Two approximations: a shorter "
           "draft is taken to be the long one's start (a block's rows attend to each other; \"3-token prefix\" is "
           "the share of positions where a 3-token draft is), and every draft is returned whole (no cut-off). "
           "\"60 % line\" is the issue's goal for the adaptive loop, 60 % of the oracle's gain; \"share\" is "
           "the part of the oracle's gain that the free-drafts policy reaches.",
           "",
           "| set | positions | accepted per position | 3-token prefix | oracle | 60 % line | best causal | "
           "best gate | engine, replayed | engine, walk's confidence alone | measured adaptive | "
           "causal, free drafts (share) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in r["sets"].items():
        m = s["summary"]
        walk = m.get("engine_replay_walk_conf_x")
        pre = m.get("short_draft_is_prefix")
        gain, free = m["oracle_x"] - 1.0, m["free_drafts"]["best_x"]
        share = f"{(free - 1.0) / gain:.2f}" if gain > 0 else "—"
        out.append(f"| {name} | {m['positions']} | {m['mean_accepted']:.2f} | "
                   f"{'—' if pre is None else f'{pre:.3f}'} | {m['oracle_x']:.3f}× | {1.0 + 0.6 * gain:.3f}× | "
                   f"{m['causal']['best_x']:.3f}× ({m['causal']['best']}) | "
                   + (f"{m['gated']['best_x']:.3f}× ({m['gated']['best']}) | " if "gated" in m else "— | ")
                   + f"{m['engine_replay_x']:.3f}× | "
                   f"{'—' if walk is None else f'{walk:.3f}×'} | "
                   f"{m['auto_x']:.3f}× (plain {m['plain_tok_s']:.1f} tok/s; {m['auto_plain_steps']} steps plain) | "
                   f"{free:.3f}× ({m['free_drafts']['best']}; {share}) |")
    out += ["", "Cost model of the run (ms): verify batches of 1 … n rows "
            f"{[round(x, 2) for x in cm['t_verify']]}, drafts of 1 … n tokens {[round(x, 2) for x in cm['t_draft']]}.",
            ""]
    if r.get("inject_ms_per_row"):
        out += [f"The engine's replays also price what a draft pays first: injecting the feature rows committed "
                f"since the last draft, {r['inject_ms_per_row']:.4f} ms a row (`bench_policy.inject_cost`: a draft "
                "after 64 queued rows against one after one row, each right after a target decode"
                + (f"; analysed as `{r['analysed'].split(' at ')[0]}`" if r.get("analysed") else "")
                + "). The oracle and the causal family leave it out.", ""]
    return out


def blind() -> list[str]:
    if not (HERE / "blind.json").is_file():
        return []
    r = _load("blind.json")
    out = ["### Draft sources without confidences, replayed", "",
           _source(r["command"], r["date"], "blind.json", f"; {r['tokens']} tokens per generation"), "",
           "A `draft_source=` callable gives no confidences: the engine keeps a belief over its acceptance from "
           "the slots it verified (docs/architecture.md §5.9). Here a source at i.i.d. acceptance p is replayed "
           "with the engine's policy (`core.policy.replay`: no model runs) on measured verify costs, against "
           f"plain decoding. warm: {r['gens']} generations one after the other (the second of two passes); cold: "
           "a fresh engine, two generations; mean / worst of "
           f"{r['seeds']} seeds. 'best fixed': the best fixed draft length on the same traces (the policy does "
           "not know it). 'turns good': 4 generations at p = 0.3, then 4 at p = 0.9, the speed over the "
           "second half; 'turns bad': the other way round; 'mixed': 12 generations from a fresh engine, each at "
           "its own p, against the best fixed length of each.", "",
           "| verify costs | t(2) / t(1) | p | warm | cold | best fixed |", "|---|---|---|---|---|---|"]
    for label, c in r["curves"].items():
        tv = c["t_verify_ms"]
        for p, v in c["p"].items():
            out.append(f"| {label} | {tv[1] / tv[0]:.2f} | {p} | {v['warm_mean']:.3f}× / {v['warm_min']:.3f}× | "
                       f"{v['cold_mean']:.3f}× / {v['cold_min']:.3f}× | {v['best_fixed']:.3f}× |")
        g, b, m = c["turns_good"], c["turns_bad"], c["mixed"]
        out.append(f"| {label} | | turns good | {g['mean']:.3f}× | | {g['best_fixed']:.3f}× |")
        out.append(f"| {label} | | turns bad | {b['mean']:.3f}× / {b['min']:.3f}× | | {b['best_fixed']:.3f}× |")
        out.append(f"| {label} | | mixed | | {m['mean']:.3f}× / {m['min']:.3f}× | {m['best_fixed_each']:.3f}× |")
    return [*out, ""]


def concurrent() -> list[str]:
    if not (HERE / "concurrent.json").is_file():
        return []
    r = _load("concurrent.json")
    out = ["## Concurrent requests", "", _source(r["command"], r["date"], "concurrent.json",
                                                f"; {r['clients']} clients, {r['requests']} requests of {r['tokens']} "
                                                "tokens per set, 2 threads"), "",
           "Completion tokens per second of wall time over the whole set (prefill included). parallel = 1 is "
           "the queue (one generation at a time); parallel = P serves up to P at once with one decode per step "
           "for all (`Llama(parallel=P).view()`, the server's `--parallel`). \"identical\" compares each answer "
           "with the queued run's.", "",
           "| set | configuration | tok/s | vs queued | rounds | drafted / accepted | identical |",
           "|---|---|---|---|---|---|---|"]
    for k, v in r["results"].items():
        sname, conf = k.split("/", 1)
        out.append(f"| {sname} | {conf} | {v['tokens_per_s']:.1f} | {v['vs_queued']:.2f} | "
                   f"{', '.join(f'{x:.1f}' for x in v['rounds'])} | {v['drafted']} / {v['accepted']} | "
                   f"{v['identical_to_queued']}/{v['compared']} |")
    if (HERE / "concurrent_kv_unified.json").is_file():  # the same bench, one unified KV cache
        k = _load("concurrent_kv_unified.json")
        rows = [f"{n} {v['vs_queued']:.2f} ({v['tokens_per_s']:.1f} tok/s, identical "
                f"{v['identical_to_queued']}/{v['compared']})"
                for n, v in k["results"].items() if "/default/" in f"/{n}"]
        out += ["", f"With one unified KV cache in the default mode ({k['date']}, same command; "
                "`concurrent_kv_unified.json`), vs queued: " + "; ".join(rows) + ". A KV stream per "
                "sequence is the layout since (long prompts, identity with the queue)."]
    return [*out, ""]


def _kernel_curves(r: dict) -> list[str]:
    out: list[str] = []
    ks = ["1", "2", "3", "4", "6", "8", "12", "16"]
    for name, c in r.get("curve", {}).items():
        g, o = c["modes"]["ggml"], c["modes"]["dflash"]
        out += [f"**{name}** ({c['weight_bytes'] / 1e6:.0f} MB of weights): one row {g['t_ms']['1']:.2f} ms (ggml) / "
                f"{o['t_ms']['1']:.2f} ms (ours); prefill of 512 tokens {c['prefill_512_tok_s']['ggml']} / "
                f"{c['prefill_512_tok_s']['dflash']} tok/s; products the kernels took, by rows: "
                f"{c['kernel_products_by_rows']}", "",
                "| k | " + " | ".join(ks) + " |", "|---|" + "---|" * len(ks),
                "| ggml t(k)/t(1) | " + " | ".join(f"{g['ratio'][k]:.2f}" for k in ks) + " |",
                "| ours t(k)/t(1) | " + " | ".join(f"{o['ratio'][k]:.2f}" for k in ks) + " |",
                "| ours t(k) / ggml t(1) | " + " | ".join(f"{o['vs_ggml_t1'][k]:.2f}" for k in ks) + " |"]
        if o.get("read_share"):
            out += ["| ours: read share | " + " | ".join(f"{o['read_share'][k]:.2f}" for k in ks) + " |",
                    "| ours: multiply-add share | " + " | ".join(f"{o['mac_share'][k]:.2f}" for k in ks) + " |"]
        out.append("")
    return out


def _kernel_e2e(r: dict) -> list[str]:
    out: list[str] = []
    for sname, rows in r.get("e2e", {}).items():
        out += [f"**End to end, {sname}** (the default model Q4_0 and the shipped drafter, greedy, 128 tokens a "
                "prompt, interleaved prompt by prompt; tok/s of decoding):", "",
                "| configuration | tok/s | vs llama-cpp-python | vs its own plain loop | tau | identical to plain |",
                "|---|---|---|---|---|---|"]
        for k, v in rows.items():
            out.append(f"| {k} | {v['tok_s']} | {v['vs_llama_cpp']:.2f} | {v.get('vs_own_plain', '')} | "
                       f"{v.get('tau', '')} | {v.get('identical_to_plain', '')} |")
        out.append("")
    return out


def _avx2_peak_note(r: dict) -> str:
    """Runs before the AVX2 peak loop was fixed timed additions only (its dot hoisted out)."""
    if r["date"] >= "2026-12-05T18:05" or not any(k.startswith("avx2") for k in r["roofline"]):
        return ""
    return (" The AVX2 int8 figure of this run is not a measurement: with constant inputs the compiler hoisted "
            "the dot out of the timed loop (fixed 2026-12-05 18:05; measured since: 86 G MAC/s a thread, 172 with 2).")


def kernels() -> list[str]:
    if not (HERE / "kernels.json").is_file():
        return []
    r = _load("kernels.json")
    out = ["## Small-batch kernels", "", _source(r["command"], r["date"], "kernels.json",
                                                 f"; {r['cpu']}, {r['threads']} threads, {r['kernels']}, "
                                                 f"load {r['load'][0]:.2f} before / {r['load_after'][0]:.2f} after"),
           "", "Roofline (`dflash_kernels_roofline`): " + "; ".join(
               f"{k.replace('/', ', ')} thread(s) read {v['read_gb_s']:.1f} GB/s, int8 {v['int8_gmac_s']:.0f} G MAC/s"
               for k, v in r["roofline"].items()) + "." + _avx2_peak_note(r), "",
           f"`llama_decode` of k rows after a {r.get('prefix', 64)}-token prefix, all logits, best of the interleaved "
           "rounds: t(k) / t(1) "
           "of ggml's kernels and of ours, ours against ggml's one-row time, and the share of the roofline ours "
           "reach (the weights read once at the measured bandwidth ÷ the time; k rows of multiply-adds at the "
           "measured int8 peak ÷ the time).", ""]
    out += _kernel_curves(r)
    out += _kernel_e2e(r)
    if (HERE / "kernels_curve.json").is_file():  # the curve measured again after later kernel changes
        c = _load("kernels_curve.json")
        out += ["### The verify curve, measured again", "",
                _source(c["command"], c["date"], "kernels_curve.json",
                        f"; {c['cpu']}, {c['threads']} threads, {c['kernels']}, load {c['load'][0]:.2f} before / "
                        f"{c['load_after'][0]:.2f} after"), ""] + _kernel_curves(c)
    if (HERE / "kernels_curve_long.json").is_file():  # where attention weighs more
        c = _load("kernels_curve_long.json")
        out += [f"### The verify curve after {c['prefix']} positions", "",
                "Attention's share grows with the context: the same measurement after a longer prefix.", "",
                _source(c["command"], c["date"], "kernels_curve_long.json",
                        f"; {c['cpu']}, {c['threads']} threads, {c['kernels']}, load {c['load'][0]:.2f} before / "
                        f"{c['load_after'][0]:.2f} after"), ""] + _kernel_curves(c)
    if (HERE / "kernels_curve_avx2.json").is_file():  # AVX2 code on both sides, as an AVX2-only CPU runs it
        c = _load("kernels_curve_avx2.json")
        out += ["### The verify curve with AVX2 code only", "",
                "As an AVX2-only CPU (AMD EPYC Zen 2) runs it, measured on this machine: llama-cpp-python "
                "built without AVX512 / AVX-VNNI and our kernels held to AVX2 (the virtualenv of "
                "`scripts/avx2-suite.sh`, `LLAMA_DFLASH_KERNELS_ISA=avx2`); an AMD CPU's own timings differ.", "",
                _source(c["command"], c["date"], "kernels_curve_avx2.json",
                        f"; {c['cpu']}, {c['threads']} threads, {c['kernels']}, load {c['load'][0]:.2f} before / "
                        f"{c['load_after'][0]:.2f} after"), ""] + _kernel_curves(c)
    if (HERE / "kernels_e2e.json").is_file():  # end to end measured again after later changes
        e = _load("kernels_e2e.json")
        out += ["### End to end, measured again", "",
                _source(e["command"], e["date"], "kernels_e2e.json",
                        f"; {e['cpu']}, {e['threads']} threads, {e['kernels']}, load {e['load'][0]:.2f} before / "
                        f"{e['load_after'][0]:.2f} after"), ""] + _kernel_e2e(e)
    return out


def catalogue() -> list[str]:
    if not (HERE / "catalogue.json").is_file():
        return []
    r = _load("catalogue.json")
    runs = r.get("runs", [r])
    out = ["## Target families", ""]
    for run in runs:  # (a run of some rows keeps the others as an earlier run measured them)
        rows = "/".join(run.get("parts", ["tiny", "real"]))
        out.append(f"- {rows} rows: " + _source(
            run["command"], run["date"], "catalogue.json",
            f"; {run['cpu']}, {run['threads']} threads, {run['kernels']}, load {run['load'][0]:.2f} before / "
            f"{run['load_after'][0]:.2f} after, {run['busy']} other pytest / bench processes running at the start"))
    out += ["", "One row per target family: the tiny random targets of `tests/families.py` (each with the drafter "
           "converted from a synthetic checkpoint in its family's published schema where that converts, else a "
           "random GGUF drafter) and the real models (random drafters shaped for them; SmolLM2 with the shipped "
           "drafter). *converts*: `llama-dflash convert` of that checkpoint, or its error. *identical*: greedy "
           "output with the drafter equal to the plain loop's on the same context, prompts identical / prompts "
           "(tokens each; exact mode where its self-check passed). *exact*: the self-check's verdict, rows = the "
           "longest verify batch bit-identical to one-token decoding (capped by the drafter's block). *tau*: mean "
           "accepted length a step with a replayed drafter, each token right with p = 0.7, draft 7 (the same "
           "draw for every row, so equal taus mean the loop accepts what it is given). *t(k)/t(1)*: "
           "`llama_decode` of k rows after 64 positions on the exact-mode context, best of the rounds (the tiny "
           "targets' t(1) is a fraction of a millisecond: their ratios are overhead, not matrix products).", "",
           "| family | converts | loads | speculates | identical (tokens) | exact (rows) | tau @ p 0.7 | "
           "t(1) ms | t(2)/t(1) | t(4)/t(1) | t(8)/t(1) | plain / spec s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        if x.get("loads") != "yes":
            out.append(f"| {x['family']} | {x['converts']} | {x['loads']} | – | – | – | – | – | – | – | – | – |")
            continue
        ex = x["exact"]
        verdict = (f"passed ({x['exact_rows']})" if ex.startswith("self-check passed") else ex)
        t = x["t_ratio"]
        out.append(f"| {x['family']} | {x['converts']} | yes | {'yes' if x['speculates'] else 'no'} "
                   f"({x['drafted']} drafted) | {x['identical']} ({x['tokens']}) | {verdict} | {x['tau']} | "
                   f"{x['t_ms']['1']:.2f} | {t['2']:.2f} | {t['4']:.2f} | {t['8']:.2f} | "
                   f"{x['plain_s']} / {x['spec_s']} |")
    return out + [""]


def rpc() -> list[str]:
    if not (HERE / "rpc.json").is_file():
        return []
    r = _load("rpc.json")
    out = ["## A target split over RPC servers", "",
           _source(r["command"], r["date"], "rpc.json",
                   f"; {r['cpu']}, {r['threads']['client']} client thread, {r['servers']} rpc-servers of "
                   f"{r['threads']['each_server']} thread on 127.0.0.1, load {r['load'][0]:.2f} before / "
                   f"{r['load_after'][0]:.2f} after"),
           "", "Every layer of the target on two loopback `rpc-server`s behind a delaying TCP proxy each "
           "(the added round trip below, measured by a ping-pong through it: "
           + ", ".join(f"{k} → {v:.2f} ms" for k, v in r["measured_rtt_ms"].items())
           + f"; direct {r['direct_rtt_ms']:.3f} ms); the drafter local. Plain decoding (the target alone: no "
           f"drafter, no capture) and adaptive speculation (the default), greedy, {r['prompts']} prompts × "
           f"{r['tokens']} tokens, interleaved prompt by prompt on two models per delay, the speculative one "
           "also with the guards' read-ahead off (docs/architecture.md §14: without it every tensor read after "
           "a decode, the logits and each tapped layer's rows, waits for a round trip of its own); tok/s of "
           "decoding; speed-ups against plain decoding. The cost model's verify costs are measured "
           "over the split at load, so they include the round trips: predicted / measured is its draft + verify "
           "time against the steps' measured one. Round trips waited: the requests whose answer came from a "
           f"server, per plain token and per speculative step (both servers). Upstream's loop: {r['upstream']}.", ""]
    for name, t in r["targets"].items():
        rows = t["delays"]
        first = next(iter(rows.values()))
        out += [f"**{name}** (drafter `{t['drafter']}`; exact mode over the split: {first['exact'] or 'off'})", "",
                "| added round trip ms | plain tok/s | adaptive tok/s (speedup) | without read-ahead | "
                "upstream's loop | tau | plain steps | identical | predicted / measured | cost model t(1) / t(8) ms | "
                "round trips waited: plain token / step / step without read-ahead |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]

        def upstream(u: dict | None) -> str:
            if not u:
                return "–"
            if "error" in u:
                return "failed"
            return f"{u['tok_s']:.1f} ({u['speedup']:.2f}×, τ {u['tau']})"

        for d, x in rows.items():
            tv = x["cost_t_verify_ms"]
            nra = (f"{x['no_read_ahead_tok_s']:.1f} ({x['no_read_ahead_speedup']:.2f}×)"
                   if "no_read_ahead_tok_s" in x else "–")
            waited = (f"{x['rpc_waited_per_plain_token']} / {x['rpc_waited_per_adaptive_step']} / "
                      f"{x['rpc_waited_per_step_no_read_ahead']}" if "rpc_waited_per_plain_token" in x else "–")
            out.append(f"| {d} | {x['plain_tok_s']:.1f} | {x['adaptive_tok_s']:.1f} ({x['speedup']:.2f}×) | {nra} | "
                       f"{upstream(x.get('upstream'))} | "
                       f"{x['tau'] if x['tau'] is not None else '–'} | {x['plain_steps']} | {x['identical']} | "
                       f"{x['predicted_over_measured']} | {tv.get('1', '–')} / {tv.get('8', '–')} | {waited} |")
        fails = {re.sub(r"\[[\d.:]+\]", "", m.group(1) if (m := re.search(r"\.(?:cpp|c):\d+: (.+?)(?: \d+ \.\./|$)",
                                                                                 u["error"])) else u["error"])
                 for x in rows.values() if (u := x.get("upstream")) and "error" in u}
        if fails:
            out += ["", "Upstream's loop aborted (its drafter local, `-devd none`): " + "; ".join(sorted(fails))]
        ds = sorted(rows, key=float)
        rtt = r.get("measured_rtt_ms", {})
        if len(ds) > 1 and float(ds[-1]) > float(ds[0]):
            lo, hi = rows[ds[0]], rows[ds[-1]]
            span = (rtt[ds[-1]] - rtt[ds[0]]) if ds[0] in rtt and ds[-1] in rtt else float(ds[-1]) - float(ds[0])
            plain_slope = (hi["plain_ms_per_token"] - lo["plain_ms_per_token"]) / span

            def step_ms(x: dict) -> float | None:  # a speculative step's measured time: tau tokens a step
                return 1e3 * x["tau"] / x["adaptive_tok_s"] if x.get("tau") else None

            st = [step_ms(x) for x in (lo, hi)]
            out += ["", f"Time added per ms of measured round trip ({ds[0]} → {ds[-1]} ms added): a plain token "
                    f"{plain_slope:.1f} ms"
                    + (f", a speculative step {(st[1] - st[0]) / span:.1f} ms (tau ÷ adaptive tok/s)"
                       if None not in st else "") + "."]
        shapes = [(d, x["decode_by_shape"]) for d, x in rows.items() if x.get("decode_by_shape")]
        if shapes:
            out += ["", "`llama_decode` of the target alone over the split, median ms (1 and 8 rows, each repeated, "
                    "and the two alternating, as adaptive steps vary):", "",
                    "| added round trip ms | 1 row | 8 rows | alternating: 1 row | alternating: 8 rows |",
                    "|---|---|---|---|---|"]
            for d, sh in shapes:
                out.append(f"| {d} | {sh['1_repeated/1']['ms']} | {sh['8_repeated/8']['ms']} | "
                           f"{sh['1_8_alternating/1']['ms']} | {sh['1_8_alternating/8']['ms']} |")
        out.append("")
    if r.get("plot"):
        out += [f"![tok/s and speedup against the added round trip](results/{r['plot']})", ""]
    return out


def render() -> str:
    head = ["# Measured results", "",
            "Generated by `python3 bench/report.py` from `bench/results/*.json` — do not edit by hand; re-run the "
            "benchmark named in a section, then the script. All runs: this project's 2-core x86_64 CPU machine, "
            "SmolLM2-135M-Instruct (Q4_0) as the target unless a section says otherwise.", "",
            "Contents: [core](#core-capture-drafter-step-verification-loop) · [converter](#converter) · "
            "[shipped drafter on HumanEval](#the-shipped-drafter-on-humaneval-held-out) · "
            "[drop-in class](#the-drop-in-class) · [exact mode](#exact-mode) · "
            "[small-batch kernels](#small-batch-kernels) · [target families](#target-families) · "
            "[RPC split](#a-target-split-over-rpc-servers) · "
            "[cost-aware drafting](#cost-aware-drafting) · [concurrent requests](#concurrent-requests) · "
            "[training data](#training-data) · "
            "[measured by hand](#measured-by-hand-no-json-in-benchresults)", ""]
    body = [*core(), *quant(), *convert(), *humaneval(), *humaneval_raw(), *previous_drafter(), *drafters(), *heldout(),
            *datasize(),
            *train_smoke(),
            *dropin(), *exact(), *kernels(), *catalogue(), *rpc(), *adaptive(), *blind(), *concurrent(),
            *training_data()]
    return "\n".join(head + body) + "\n" + BY_HAND


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if bench/RESULTS.md differs from what the json gives")
    ap.add_argument("--stdout", action="store_true", help="print instead of writing bench/RESULTS.md")
    a = ap.parse_args(argv)
    text = render()
    if a.stdout:
        sys.stdout.write(text)
        return 0
    if a.check:
        same = OUT.is_file() and OUT.read_text() == text
        print(f"{OUT}: {'up to date' if same else 'out of date: run python3 bench/report.py'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost-aware drafting against fixed draft lengths, the peers and the ceiling (issue: never slower).

Interleaved prompt by prompt in one run (machine noise hits every configuration alike), on the
default model and the shipped drafter, greedy and T = 0.7 (match verification, one seed per prompt):
  - llama-cpp-python plain (llama_cpp.Llama.generate) and its prompt-lookup drafter
    (LlamaPromptLookupDecoding, num_pred_tokens 10);
  - with --upstream: upstream llama.cpp's own DFlash loop (llama-speculative-simple --spec-type
    draft-dflash, built from the same llama.cpp by bench/build-upstream.sh) on the same two files,
    greedy, n = 3 and n_max: its own decode speed and acceptance, from its log;
  - our loop plain, fixed n (--fixed), and adaptive (speculation "auto", the default);
  - the ceiling: an oracle length policy that commits exactly the tokens the drafter gets accepted
    (from the run at n_max), drafting and verifying those or more where a larger batch costs less,
    and pays the cost model's times -- the best any length policy can do with this drafter on this
    machine.
With --exact our loop runs in exact mode (flash attention, the weight layout core.exact.weight_layout
picks; every adaptive output checked identical to our plain one) and a third peer joins: llama-cpp-python
under the same settings (llama_cpp.Llama(flash_attn=True), same layout, ggml's reference CPU kernels),
whose greedy output ours must equal token for token.
Prompt sets: the first --problems HumanEval problems (held out of the drafter's training), a prose /
chat set written for this bench (PROSE), and the prose set with a random-weight DFlash2 drafter
(useless drafts: adaptive must not lose to plain).  Decode tok/s excludes prefill everywhere.

With --parts replay: Qwen2.5-Coder-1.5B and Gemma-3-270M with a replayed draft source at a fixed
per-slot acceptance 0.3 / 0.5 / 0.7 / 0.9 (fixed n = 3, 7 and adaptive): the cost model's predicted
draft + verify time against the measured one, and where speculation starts to pay.

Usage: python3 bench/bench_adaptive.py [--parts sets,replay] [--problems 20] [--prose 20] [--tokens 128]
                                       [--fixed 1,2,3,5,7] [--upstream] [--exact] [--out bench/results/adaptive.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import llama_cpp
from bench_exact import random_drafters
from bench_humaneval import SAMPLING, plain_llama_cpp
from llama_cpp import _logger
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from llama_dflash import SamplingParams, SpeculativeGenerator
from llama_dflash.api.models import default_target, shipped_drafter
from llama_dflash.core import exact
from llama_dflash.train.prompts import chatml, humaneval_prompts

PROSE = [
    "Tell me a short story about a lighthouse keeper who befriends a seagull.",
    "Explain how photosynthesis works to a ten-year-old.",
    "Write a polite email declining an invitation to a conference.",
    "What were the main causes of the French Revolution?",
    "Describe the water cycle in a few sentences.",
    "Give me three tips for sleeping better.",
    "Summarise the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What is the difference between weather and climate?",
    "Suggest a name for a bakery and explain why.",
    "How do vaccines train the immune system?",
    "Write a short product description for a reusable water bottle.",
    "What should I pack for a weekend hiking trip?",
    "Explain the rules of chess in simple terms.",
    "Write a limerick about a cat who loves rain.",
    "Why do leaves change colour in autumn?",
    "Describe a busy market in the morning.",
    "What are the benefits of learning a second language?",
    "Write a thank-you note to a teacher.",
]


class Agg:
    """Tokens and seconds per configuration, plus per-prompt ratios and adaptive-step counters."""

    def __init__(self) -> None:
        self.d: dict[str, dict] = {}

    def add(self, key: str, tokens: int, secs: float, stats=None) -> None:
        d = self.d.setdefault(key, {"tokens": 0, "seconds": 0.0, "per_prompt": [], "steps": 0, "plain_steps": 0,
                                    "drafted": 0, "accepted": 0, "lengths": [], "t_pred": 0.0, "t_meas": 0.0})
        d["tokens"] += tokens
        d["seconds"] += secs
        d["per_prompt"].append(tokens / secs if secs > 0 else 0.0)
        if stats is not None:
            d["steps"] += stats.steps
            d["drafted"] += stats.drafted
            d["accepted"] += stats.accepted
            d["plain_steps"] += stats.plain_steps
            d["t_pred"] += stats.t_predicted_s
            d["t_meas"] += stats.t_draft_s + stats.t_verify_s
            for k, c in enumerate(stats.lengths):
                if k >= len(d["lengths"]):
                    d["lengths"].append(0)
                d["lengths"][k] += c

    def summary(self) -> dict:
        out = {}
        base = self.d.get("ours_plain")
        for k, d in self.d.items():
            row = {"tok_s": round(d["tokens"] / d["seconds"], 1) if d["seconds"] else 0.0, "tokens": d["tokens"]}
            if base and k != "ours_plain":
                row["vs_ours_plain"] = round(row["tok_s"] / (base["tokens"] / base["seconds"]), 3)
                ratios = [a / b for a, b in zip(d["per_prompt"], base["per_prompt"], strict=True) if b > 0]
                row["per_prompt_min"] = round(min(ratios), 3)
                row["per_prompt_geomean"] = round(statistics.geometric_mean(ratios), 3)
            if d["steps"]:
                row.update(tau=round((d["accepted"] + d["steps"]) / d["steps"], 2), steps=d["steps"])
            if d["plain_steps"] or d["t_pred"]:
                row.update(plain_steps=d["plain_steps"], lengths=d["lengths"],
                           predicted_over_measured=round(d["t_pred"] / d["t_meas"], 3) if d["t_meas"] else None)
            out[k] = row
        if "lcpp_plain" in out and "ours_plain" in out:
            out["ours_plain"]["vs_llama_cpp"] = round(out["ours_plain"]["tok_s"] / out["lcpp_plain"]["tok_s"], 3)
        if {"oracle", "auto", "ours_plain"} <= out.keys():
            p, o, a = out["ours_plain"]["tok_s"], out["oracle"]["tok_s"], out["auto"]["tok_s"]
            out["auto"]["fraction_of_ceiling_gain"] = round((a - p) / (o - p), 3) if o > p else None
        return out


class Upstream:
    """Upstream's DFlash loop as a peer: one llama-speculative-simple process per prompt."""

    def __init__(self, binary: str, target: Path, drafter: Path, threads: int = 2, rpc: str | None = None) -> None:
        """rpc: "host:port,..." to split the target over rpc-servers (all its layers; the drafter
        local, upstream's own workaround for its drafters over RPC)."""
        self.binary, self.target, self.drafter, self.threads, self.rpc = binary, target, drafter, threads, rpc

    def run(self, text: str, n_tok: int, n_draft: int):
        """(tokens, decode seconds, stats-like counters) of one greedy generation."""
        import re
        import subprocess
        import tempfile
        from types import SimpleNamespace

        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            t = str(self.threads)
            place = ["-ngl", "0"] if self.rpc is None else ["--rpc", self.rpc, "-ngl", "99", "-devd", "none"]
            r = subprocess.run([self.binary, "-m", str(self.target), "-md", str(self.drafter), "--spec-type",
                                "draft-dflash", "--spec-draft-n-max", str(n_draft), "-f", f.name, "--no-escape",
                                "-n", str(n_tok), "--temp", "0", "--top-k", "1", "--seed", "1", "-c", "1024",
                                "-t", t, "-td", t, *place, "-ngld", "0"],
                               capture_output=True, text=True, timeout=600)
        log = r.stdout + r.stderr
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        drafted, accepted = (re.search(rf"{k}\s*=\s*(\d+)", log) for k in ("n_drafted", "n_accept"))
        if r.returncode != 0 or not (m and drafted and accepted):
            raise RuntimeError(f"llama-speculative-simple failed ({r.returncode}): {log[-800:]}")
        n, secs, d, acc = int(m.group(1)), float(m.group(2)), int(drafted.group(1)), int(accepted.group(1))
        steps = -(-d // n_draft)  # it drafts n_draft tokens every step
        return n, secs, SimpleNamespace(steps=steps, drafted=d, accepted=acc, plain_steps=0, t_predicted_s=0.0,
                                        t_draft_s=0.0, t_verify_s=0.0, lengths=[])


def run_set(g: SpeculativeGenerator, llm, lookup, prompts: list[str], n_tok: int, fixed: list[int], sp_kind: str,
            peers: bool, upstream: Upstream | None = None, llm_same=None) -> dict:
    agg = Agg()
    t0 = time.time()
    for i, text in enumerate(prompts):
        toks = g.tokenize(text)
        seed = 1000 + i
        sp = SamplingParams(seed=seed, **SAMPLING) if sp_kind == "t0.7" else None
        temp = SAMPLING["temperature"] if sp_kind == "t0.7" else 0.0
        if peers:  # (as it runs without llama-dflash: until 2026-12-05 18:15 these arms ran on our kernels)
            ref, secs = plain_llama_cpp(llm, toks, n_tok, temp, seed)
            agg.add("lcpp_plain", max(0, len(ref) - 1), secs)
            out, secs = plain_llama_cpp(lookup, toks, n_tok, temp, seed)
            agg.add("lcpp_prompt_lookup", max(0, len(out) - 1), secs)
        same = None
        if peers and llm_same is not None:  # (with our kernels: the numerics ours must equal)
            same, secs = plain_llama_cpp(llm_same, toks, n_tok, temp, seed, our_kernels=True)
            agg.add("lcpp_plain_same_settings", max(0, len(same) - 1), secs)
        r = g.generate(toks, n_tok, draft_len=0, sampling=sp)
        plain_tokens = max(0, r.stats.n_generated - 1)
        agg.add("ours_plain", plain_tokens, r.stats.t_total_s)
        plain_secs = r.stats.t_total_s
        plain = r.tokens
        if same is not None and sp_kind == "greedy" and list(same[:len(plain)]) != list(plain[:len(same)]):
            raise AssertionError(f"prompt {i}: exact mode's plain output differs from llama-cpp-python's")
        for n in fixed:
            steps: list[dict] = []
            r = g.generate(toks, n_tok, draft_len=n, speculation="on", sampling=sp,
                           on_step=steps.append if n == g.max_draft_len else None)
            agg.add(f"fixed_n{n}", max(0, r.stats.n_generated - 1), r.stats.t_total_s, r.stats)
            if n == g.max_draft_len:  # the ceiling: exactly the accepted drafts, at the cost model's prices
                # (its ratio to plain, applied to our plain run: the fixed run's output may end elsewhere
                # -- default-mode numerics, a random drafter -- and its token count is not the plain one's)
                agg.add("oracle", plain_tokens, plain_secs / g.ceiling([s["accepted"] for s in steps]))
        r = g.generate(toks, n_tok, sampling=sp)
        agg.add("auto", max(0, r.stats.n_generated - 1), r.stats.t_total_s, r.stats)
        if g.exact and r.tokens != plain:
            raise AssertionError(f"prompt {i}: exact mode's adaptive output differs from its plain one")
        if upstream is not None and sp_kind == "greedy":
            for n in sorted({3, g.max_draft_len}):
                agg.add(f"upstream_dflash_n{n}", *upstream.run(text, n_tok, n))
        print(f"  [{i + 1}/{len(prompts)}] {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return agg.summary()


def _record(agg: dict, key: str, r) -> None:
    s = r.stats
    agg.setdefault(key, []).append((s.n_generated - 1, s.t_total_s, s.t_predicted_s, s.t_draft_s + s.t_verify_s,
                                    s.plain_steps, s.steps))


def replay_part(n_tok: int, acceptances: list[float], fixed: list[int]) -> dict:
    """Bigger targets with a replayed draft source at a fixed per-slot acceptance p (each drafted
    token right with probability p while the ones before it were): the cost model's predicted step
    time against the measured one, and where speculation starts to pay.  In exact mode: the
    replayed text is plain decoding's, and in the default mode a near tie rounded apart by a verify
    batch would leave the source replaying another text, every draft rejected from there on (what
    the runs of 2026-12-01 measured after their first divergence).  Exact mode verifies at most 7
    rows on these K-quant targets (its self-check), so the longest fixed length is 6."""
    import random

    from llama_dflash.api.models import pypi_target
    from llama_dflash.verify.oracle import ReplayDraftSource

    out = {}
    prompts = [chatml("Write a Python function that returns the n-th Fibonacci number."),
               chatml("Explain what a hash table is.")]
    for label, target in (("Qwen2.5-Coder-1.5B Q4_K_M", pypi_target("qwen2.5-coder-1.5b")),
                          ("Gemma-3-270M Q4_K_M", pypi_target("gemma-3-270m"))):
        agg: dict[str, dict] = {}
        with SpeculativeGenerator(target, None, n_ctx=1024, n_threads=2, exact=True) as g:
            # an adaptive warm-up measures the cost model first, so every run below (plain ones too) is predicted
            g.generate(prompts[0], 4, draft_source=lambda h, n: [], draft_len=15, speculation="auto")
            for text in prompts:
                toks = g.tokenize(text)
                ref = g.generate(toks, n_tok, draft_len=0, stop_on_eos=False)
                _record(agg, "plain", ref)
                for p in acceptances:
                    for n in [None, *fixed]:  # adaptive first: the cost model then predicts the fixed runs
                        rng = random.Random(7)

                        def corrupt(step, k, rng=rng, p=p):
                            i = 0
                            while i < k and rng.random() < p:
                                i += 1
                            return i  # the first wrong slot (k: none)

                        src = ReplayDraftSource(toks + ref.tokens, g.n_vocab, corrupt)
                        r = g.generate(toks, n_tok, stop_on_eos=False, draft_source=src,
                                       draft_len=n or 15, speculation="on" if n else "auto")
                        if r.tokens != ref.tokens:
                            raise AssertionError(f"{label} p={p} n={n}: exact mode diverged from plain decoding")
                        _record(agg, f"p{p}/" + (f"fixed_n{n}" if n else "auto"), r)
            cm = g.cost_model()
        base = sum(x[0] for x in agg["plain"]) / sum(x[1] for x in agg["plain"])
        rows = {}
        for key, runs in agg.items():
            tok, secs = sum(x[0] for x in runs), sum(x[1] for x in runs)
            row = {"tok_s": round(tok / secs, 2), "vs_plain": round(tok / secs / base, 3)}
            pred, meas = sum(x[2] for x in runs), sum(x[3] for x in runs)
            if pred:
                row.update(predicted_over_measured=round(pred / meas, 3),
                           plain_steps=sum(x[4] for x in runs), steps=sum(x[5] for x in runs))
            rows[key] = row
        rows["cost_model_ms"] = {k: [round(1e3 * x, 1) for x in cm[k]] for k in ("t_verify",)}
        out[label] = rows
        print(label, json.dumps(rows), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--prose", type=int, default=len(PROSE), help="the first N prose prompts")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--fixed", default="1,2,3,5,7", help="fixed draft lengths (the largest should be n_max)")
    ap.add_argument("--parts", default="sets,replay", help="sets: the prompt sets; replay: bigger targets")
    ap.add_argument("--replay-tokens", type=int, default=128, help="tokens per prompt of the replay part")
    ap.add_argument("--upstream", action="store_true",
                    help="add upstream's DFlash loop (bench/build-upstream.sh builds it on first use)")
    ap.add_argument("--exact", action="store_true", help="our loop in exact mode, plus llama-cpp-python under its "
                    "settings as a peer")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "adaptive.json"))
    a = ap.parse_args()
    path = Path(a.out)
    res = json.loads(path.read_text()) if path.is_file() else {}
    run = {"command": "python3 bench/bench_adaptive.py " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now().isoformat(timespec="seconds")}
    if "replay" in a.parts.split(","):
        res["replay"] = {**run, "tokens": a.replay_tokens,
                         "targets": replay_part(a.replay_tokens, [0.3, 0.5, 0.7, 0.9], [3, 6]), "exact": True}
        path.write_text(json.dumps(res, indent=1))
    if "sets" not in a.parts.split(","):
        return
    _logger.set_verbose(False)
    target, drafter = default_target(), shipped_drafter()
    fixed = [int(x) for x in a.fixed.split(",")]
    he = [chatml(p.text) for p in humaneval_prompts()[: a.problems]]
    prose = [chatml(p) for p in PROSE[: a.prose]]
    llm = llama_cpp.Llama(str(target), n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)
    lookup = llama_cpp.Llama(str(target), n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False,
                             draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
    llm_same = None
    if a.exact:  # llama-cpp-python under exact mode's settings: the same numerics as ours, token for token
        layout = exact.weight_layout(target, 2)
        orig = llama_cpp.llama_cpp.llama_model_default_params

        def params():
            p = orig()
            p.use_extra_bufts = layout
            return p

        llama_cpp.llama.llama_cpp.llama_model_default_params = params
        try:
            llm_same = llama_cpp.Llama(str(target), n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False,
                                       flash_attn=True)
        finally:
            llama_cpp.llama.llama_cpp.llama_model_default_params = orig
        exact.reference_kernels(llm_same._ctx.ctx)  # as exact mode runs them (past 256 positions they differ)
    res.update(run, threads=2, tokens=a.tokens, target=target.name, drafter=drafter.name, sets={}, exact=a.exact)
    up = None
    if a.upstream:
        import subprocess

        binary = subprocess.run(["bash", str(Path(__file__).resolve().parent / "build-upstream.sh")],
                                capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        up = Upstream(binary, target, drafter)
    with SpeculativeGenerator(target, drafter, n_ctx=1024, n_threads=2, exact=a.exact) as g:
        g.generate(he[0], 8)  # warm-up; measures (or loads) the cost model
        fixed = [n for n in fixed if n <= g.max_draft_len]
        for sp_kind in ("greedy", "t0.7"):
            for name, ps in (("humaneval", he), ("prose", prose)):
                print(f"{name} {sp_kind}", file=sys.stderr, flush=True)
                res["sets"][f"{name}/{sp_kind}"] = run_set(g, llm, lookup, ps, a.tokens, fixed, sp_kind, True, up,
                                                           llm_same)
                print(json.dumps(res["sets"][f"{name}/{sp_kind}"]), flush=True)
        res["cost_model_ms"] = {k: [round(1e3 * x, 2) for x in g.cost_model()[k]] for k in ("t_verify", "t_draft")}
    rnd = random_drafters(target, "smollm2", dict(n_layer=1, n_embd=576, n_ff=512, n_head=9, n_head_kv=3,
                                                     head_dim=64, target_layers=[1, 14, 27], mask_token_id=16,
                                                     rope_theta=100000.0, rms_eps=1e-5, n_vocab=49152))["random-v2"]
    with SpeculativeGenerator(target, rnd, n_ctx=1024, n_threads=2, exact=a.exact) as g:
        g.generate(prose[0], 8)
        print("prose greedy, random drafter", file=sys.stderr, flush=True)
        res["sets"]["prose/greedy/random-drafter"] = run_set(g, llm, lookup, prose, a.tokens, [g.max_draft_len],
                                                             "greedy", False)
        print(json.dumps(res["sets"]["prose/greedy/random-drafter"]), flush=True)
    for m in (llm, lookup, llm_same):
        if m is not None:
            m.close()
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

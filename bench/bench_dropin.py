"""The drop-in class (llama_dflash.Llama) against plain llama-cpp-python, side by side.

Three measurements, all on the default target (SmolLM2-135M-Instruct Q4_0) and the shipped drafter:

  overhead  the completion loop's own cost per token (no model work: both loops are fed the same
            recorded tokens), at 500 / 1000 / 2000 tokens, streaming and not, with a stop string:
            llama-cpp-python's _create_completion vs ours.
  memory    peak RSS of a 1000-token completion with logprobs=5 (a fresh process each):
            llama_cpp.Llama needs logits_all=True (an n_ctx x n_vocab buffer); ours does not;
            and plain llama_cpp.Llama without logprobs, the floor.
  logprobs  our logprobs (no logits_all) against llama-cpp-python's on greedy completions, next to
            llama-cpp-python's own deviation when it evaluates the same tokens in one batch.
  grammar   JSON-schema and forced tool-call chats, greedy: tau, acceptance, tok/s after the first
            token with grammar-aware drafting on and off, our loop without drafts, and plain
            llama_cpp.Llama's, prompt by prompt; where an output differs from plain's, plain
            llama-cpp-python's logit gap between the two tokens there, one token per decode and
            in the speculative run's own verify batches.

Its llama_cpp.Llama instances run in a process that imported llama-dflash, so their small matrix
products are our kernels' too (registered for every context; since 2026-12-05): the comparisons are
of the two classes on the same products, not of stock llama-cpp-python's speed (bench_adaptive.py
and bench_kernels.py measure that with our kernels switched off).

Usage: python bench/bench_dropin.py [--only overhead,memory,logprobs,grammar] [--out bench/results/dropin.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp
from llama_cpp import _logger

import llama_dflash
from llama_dflash.api import completion
from llama_dflash.api.llama import openai_response_format
from llama_dflash.api.models import default_target, shipped_drafter
from llama_dflash.verify.certify import certify
from llama_dflash.verify.certify import checker as make_checker

_logger.set_verbose(False)


# ---- overhead -------------------------------------------------------------------------------

class _Replay:
    """generate() that yields recorded tokens: the completion loop alone is timed."""

    tokens: list[int] = []

    def generate(self, tokens, **kw):
        yield from self.tokens


class PlainReplay(_Replay, llama_cpp.Llama):
    pass


def loop_cost(llm, run, n: int, stream: bool) -> float:
    """Seconds per token of one completion of n replayed tokens."""
    t0 = time.perf_counter()
    out = run(llm, "Write a story.", max_tokens=n, stop=["###"], stream=stream, temperature=0.0)
    if stream:
        for _ in out:
            pass
    else:
        next(out)
    return (time.perf_counter() - t0) / n


def overhead(target: str) -> list[dict]:
    llm = PlainReplay(target, n_ctx=4096, verbose=False)
    # a realistic token stream: the model's own greedy text, repeated
    src = llama_cpp.Llama(target, n_ctx=1024, verbose=False)
    text = src.create_chat_completion([{"role": "user", "content": "Write a long story about a robot."}],
                                      max_tokens=400, temperature=0.0)["choices"][0]["message"]["content"]
    src.close()
    toks = llm.tokenize(text.encode(), add_bos=False, special=False)
    rows = []
    for n in (500, 1000, 2000):
        PlainReplay.tokens = (toks * (n // len(toks) + 1))[:n]
        for stream in (False, True):
            theirs = min(loop_cost(llm, lambda m, p, **k: llama_cpp.Llama._create_completion(m, p, **k), n, stream)
                         for _ in range(2))
            ours = min(loop_cost(llm, completion.create_completion, n, stream) for _ in range(2))
            rows.append({"tokens": n, "stream": stream, "llama_cpp_ms_per_token": theirs * 1e3,
                         "ours_ms_per_token": ours * 1e3})
            print(f"  {n:5d} tokens stream={stream!s:5}: llama-cpp-python {theirs * 1e3:.3f} ms/token, "
                  f"ours {ours * 1e3:.3f} ms/token", flush=True)
    llm.close()
    return rows


# ---- memory -----------------------------------------------------------------------------------

_MEM_CHILD = """
import resource, sys, json
import llama_cpp, llama_dflash
kind, target, drafter = sys.argv[1:4]
lp = None if kind == "plain_no_logprobs" else 5
if kind.startswith("plain"):
    llm = llama_cpp.Llama(target, n_ctx=4096, logits_all=lp is not None, verbose=False)
else:
    llm = llama_dflash.Llama(target, n_ctx=4096, verbose=False, draft_model_path=drafter)
r = llm.create_completion("<|im_start|>user\\nWrite a long story about a robot.<|im_end|>\\n<|im_start|>assistant\\n",
                          max_tokens=1000, logprobs=lp, temperature=0.0)
print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "tokens": r["usage"]["completion_tokens"],
                  "logprobs": len((r["choices"][0]["logprobs"] or {}).get("token_logprobs", []))}))
"""


def memory(target: str, drafter: str) -> dict:
    out = {}
    for kind in ("plain", "ours", "plain_no_logprobs"):
        r = subprocess.run([sys.executable, "-c", _MEM_CHILD, kind, target, drafter], capture_output=True,
                           text=True, check=True)
        out[kind] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"  {kind:17}: peak RSS {out[kind]['peak_rss_mib']:.0f} MiB "
              f"({out[kind]['tokens']} tokens, {out[kind]['logprobs']} logprobs)", flush=True)
    return out


# ---- logprobs ----------------------------------------------------------------------------------

def logprobs(target: str, drafter: str, n: int = 48) -> list[dict]:
    """Our logprobs (no logits_all) vs llama-cpp-python's (logits_all=True) on the same greedy
    completions, next to how far llama-cpp-python's own logprobs move when it evaluates the
    same tokens in one batch instead of one per llama_decode."""
    import numpy as np

    from llama_dflash.train.prompts import chatml, humaneval_prompts

    base = llama_cpp.Llama(target, n_ctx=1024, logits_all=True, verbose=False)
    spec = llama_dflash.Llama(target, n_ctx=1024, verbose=False, draft_model_path=drafter, draft_n_max=3)
    rows = []
    for p in humaneval_prompts()[:4]:
        prompt = chatml(p.text)
        w = base.create_completion(prompt, max_tokens=n, temperature=0.0, logprobs=3)["choices"][0]["logprobs"]
        g = spec.create_completion(prompt, max_tokens=n, temperature=0.0, logprobs=3)["choices"][0]["logprobs"]
        k = next((i for i, (x, y) in enumerate(zip(w["tokens"], g["tokens"], strict=False)) if x != y),
                 min(len(w["tokens"]), len(g["tokens"])))  # compare up to a (certified) divergence
        ours = np.abs(np.array(g["token_logprobs"][:k]) - np.array(w["token_logprobs"][:k], dtype=np.float64))
        toks = base.tokenize(prompt.encode(), add_bos=False, special=True)
        comp = base.tokenize("".join(w["tokens"][:k]).encode(), add_bos=False, special=False)[:k]
        base.reset()
        base.eval(toks + comp)
        lp = llama_cpp.Llama.logits_to_logprobs(base.scores[len(toks) - 1:len(toks) - 1 + len(comp)])
        one = np.abs(lp[np.arange(len(comp)), comp] - np.array(w["token_logprobs"][:len(comp)], dtype=np.float64))
        rows.append({"problem": p.key, "tokens": int(k), "ours_vs_plain_max": float(ours.max()),
                     "ours_vs_plain_median": float(np.median(ours)), "plain_batch_vs_plain_max": float(one.max()),
                     "plain_batch_vs_plain_median": float(np.median(one))})
        print(f"  {p.key}: {k} tokens | ours vs plain: max {ours.max():.4f}, median {np.median(ours):.4f} | "
              f"plain in one batch vs plain: max {one.max():.4f}, median {np.median(one):.4f}", flush=True)
    spec.close()
    base.close()
    return rows


# ---- grammar ----------------------------------------------------------------------------------

PERSON = {"type": "object", "required": ["name", "age", "languages"], "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5}}}
BOOK = {"type": "object", "required": ["title", "author", "year", "genres"], "properties": {
    "title": {"type": "string", "maxLength": 40}, "author": {"type": "string", "maxLength": 30},
    "year": {"type": "integer"}, "genres": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                            "maxItems": 4}}}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": {
    "type": "object", "required": ["city", "days", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 30}, "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]
SEARCH = [{"type": "function", "function": {"name": "search_code", "description": "Search a code base", "parameters": {
    "type": "object", "required": ["query", "language", "max_results"], "properties": {
        "query": {"type": "string", "maxLength": 60}, "language": {"type": "string", "maxLength": 16},
        "max_results": {"type": "integer"}}}}}]

CASES = [
    ("json", "Describe a fictional programmer as JSON with name, age and languages.", dict(
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})),
    ("json", "Give me a JSON object for a famous science fiction novel.", dict(
        response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": BOOK}})),
    ("json", "Invent a person who speaks several languages; answer in JSON.", dict(
        response_format={"type": "json_object", "schema": PERSON})),
    ("json", "Return a JSON record of a classic fantasy book.", dict(
        response_format={"type": "json_object", "schema": BOOK})),
    ("tool", "What will the weather be in Paris for the next three days?", dict(
        tools=WEATHER, tool_choice={"type": "function", "function": {"name": "get_weather"}})),
    ("tool", "Is it going to rain in Tokyo this week? Use fahrenheit.", dict(
        tools=WEATHER, tool_choice={"type": "function", "function": {"name": "get_weather"}})),
    ("tool", "Find Python functions that parse JSON in our repository.", dict(
        tools=SEARCH, tool_choice={"type": "function", "function": {"name": "search_code"}})),
    ("tool", "Look for Rust code that opens a TCP socket, at most 5 results.", dict(
        tools=SEARCH, tool_choice={"type": "function", "function": {"name": "search_code"}})),
]


def _timed(llm, msgs, kw, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first chunk, seconds after it) of one streamed greedy chat completion."""
    t0 = time.perf_counter()
    first = None
    for _ in llm.create_chat_completion(msgs, max_tokens=max_tokens, temperature=0.0, stream=True, **kw):
        first = first or time.perf_counter()
    return first - t0, time.perf_counter() - first


def _tokens(llm) -> list[int]:
    """What the last completion left evaluated: prompt + completion (but its last token)."""
    return llm.input_ids[:llm.n_tokens].tolist()


def _describe(d: dict) -> str:
    b = d["gap_in_spec_batches"]
    return (f"differs at token {d['position']}: plain gap {d['gap_one_by_one']:.3f}, "
            + (f"{b:.3f} in the speculative batches" if b is not None else "batches not replayed")
            + (" (certified)" if d["certified"] else " (NOT explained)"))


def grammar(target: str, drafter: str, n_draft: int, max_tokens: int) -> list[dict]:
    plain = llama_cpp.Llama(target, n_ctx=2048, verbose=False)
    spec = llama_dflash.Llama(target, n_ctx=2048, verbose=False, draft_model_path=drafter, draft_n_max=n_draft)
    checker = make_checker(target, 2048)  # every row of a batch
    steps: list[dict] = []

    def on_step(st):
        steps.append({"drafted": st["drafted"], "accepted": st["accepted"], "committed": st["committed"]})
    rows = []
    for kind, prompt, kw in CASES:
        msgs = [{"role": "user", "content": prompt}]
        # llama-cpp-python ignores OpenAI's json_schema form: give it the equivalent json_object
        plain_kw = {**kw, "response_format": openai_response_format(kw["response_format"])} \
            if "response_format" in kw else kw
        plain.reset()
        want = plain.create_chat_completion(msgs, max_tokens=max_tokens, temperature=0.0, **plain_kw)
        n_tok = want["usage"]["completion_tokens"]
        ref = _tokens(plain)
        plain.reset()
        t_first, t_rest = _timed(plain, msgs, plain_kw, max_tokens)
        # tokens/s after the first token (prompt evaluation excluded), for all three
        row = {"kind": kind, "prompt": prompt, "tokens": n_tok, "plain_tok_s": (n_tok - 1) / t_rest,
               "plain_first_token_s": t_first}
        # "loop": our loop without drafts -- what the argmax-first grammar check alone gives
        for key, aware, n in (("aware", True, n_draft), ("blind", False, n_draft), ("loop", True, 0)):
            spec.grammar_aware_drafting, spec.draft_n_max = aware, n
            spec.reset()  # no KV reuse from the previous run: the prompt is evaluated again, as for plain
            steps.clear()
            spec.on_step = on_step
            got = spec.create_chat_completion(msgs, max_tokens=max_tokens, temperature=0.0, **kw)
            spec.on_step = None
            st = spec.last_speculative_stats
            got_tokens = _tokens(spec)
            spec.reset()
            t_first, t_rest = _timed(spec, msgs, kw, max_tokens)
            n_got = len(_tokens(spec)) - st.n_prompt + 1
            same = got["choices"][0]["message"].get("content") == want["choices"][0]["message"].get("content") and \
                (got["choices"][0]["message"].get("tool_calls") or [{}])[0].get("function") == \
                (want["choices"][0]["message"].get("tool_calls") or [{}])[0].get("function")
            row[f"{key}_divergence"] = None if same else certify(checker, ref, got_tokens, st.n_prompt, steps)
            row.update({f"{key}_tau": st.tau, f"{key}_acceptance": st.acceptance_rate,
                        f"{key}_tok_s": (n_got - 1) / t_rest, f"{key}_first_token_s": t_first,
                        f"{key}_grammar_cut": st.grammar_cut,
                        f"{key}_grammar_skipped": st.grammar_skipped, f"{key}_grammar_argmax": st.grammar_argmax,
                        f"{key}_same_as_plain": same})
        rows.append(row)
        print(f"  {kind:4} {n_tok:4d} tok | plain {row['plain_tok_s']:5.1f} | loop, no drafts {row['loop_tok_s']:5.1f} "
              f"tok/s | aware tau {row['aware_tau']:.2f} "
              f"acc {row['aware_acceptance']:.2f} {row['aware_tok_s']:5.1f} tok/s | blind tau {row['blind_tau']:.2f} "
              f"acc {row['blind_acceptance']:.2f} {row['blind_tok_s']:5.1f} tok/s | "
              + " / ".join("same" if row[f"{k}_divergence"] is None else _describe(row[f"{k}_divergence"])
                           for k in ("aware", "blind", "loop")), flush=True)
    spec.close()
    plain.close()
    checker.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="overhead,memory,logprobs,grammar")
    ap.add_argument("--draft-lens", default="3,7")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "dropin.json"))
    a = ap.parse_args()
    target, drafter = str(default_target()), str(shipped_drafter())
    parts = a.only.split(",")
    # parts not run this time keep their earlier results; each part records its own command and date
    out = Path(a.out)
    res = json.loads(out.read_text()) if out.is_file() else {}
    res.update({"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                "llama_cpp_python": llama_cpp.__version__})
    res.setdefault("runs", {}).update({p: {"command": "python " + " ".join(sys.argv),
                                           "date": time.strftime("%Y-%m-%d %H:%M")} for p in parts})
    res.pop("command", None)
    if "overhead" in parts:
        print("completion loop overhead (replayed tokens, no model work):")
        res["overhead"] = overhead(target)
    if "memory" in parts:
        print("peak RSS, 1000 tokens with logprobs=5, n_ctx 4096:")
        res["memory"] = memory(target, drafter)
    if "logprobs" in parts:
        print("logprobs of greedy completions (4 HumanEval chats, 48 tokens), |difference| from llama-cpp-python's:")
        res["logprobs"] = logprobs(target, drafter)
    if "grammar" in parts:
        res["grammar"] = {}
        for n in (int(x) for x in a.draft_lens.split(",")):
            print(f"grammar-aware drafting, n = {n}, greedy, {a.max_tokens} tokens max:")
            res["grammar"][str(n)] = grammar(target, drafter, n, a.max_tokens)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()

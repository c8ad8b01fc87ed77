"""Two drafters side by side on held-out HumanEval prompts: τ and acceptance per position.

The first N HumanEval problems, greedy, in the chat template and as raw completion prompts (the
problem's signature and docstring, tokenized as llama-cpp-python's create_completion does), fixed
n = 3 and 7 and the adaptive default; both drafters on each prompt in turn.  τ at T = 0 does not
depend on the machine's speed; the tok/s beside it do (read them as a ratio within one run).

Usage: python3 bench/bench_drafters.py --a OLD.gguf --b NEW.gguf [--problems 20] [--tokens 128]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from llama_dflash import SpeculativeGenerator
from llama_dflash.api.models import default_target
from llama_dflash.train.prompts import chatml, humaneval_problems, humaneval_prompts


def humaneval_tau(drafters: dict[str, str], problems: int, tokens: int, lens: tuple[int, ...] = (3, 7),
                  auto: bool = True) -> dict[str, dict]:
    """τ, tok/s and acceptance per position of each named drafter on the first `problems` HumanEval
    problems, greedy, chat and raw, at each fixed length in `lens` (and the adaptive default), the
    drafters on each prompt in turn.  Keys: NAME/FORMAT/n=N or NAME/FORMAT/auto."""
    gens = {k: SpeculativeGenerator(default_target(), d, n_ctx=1024, n_threads=2) for k, d in drafters.items()}
    chat = [chatml(p.text) for p in humaneval_prompts()[:problems]]
    raw = [p["prompt"] for p in humaneval_problems()[:problems]]
    agg: dict[str, dict] = {}
    for i in range(problems):
        for fmt in ("chat", "raw"):
            for name, g in gens.items():
                toks = g.tokenize(raw[i], add_special=True, parse_special=True) if fmt == "raw" \
                    else g.tokenize(chat[i])
                for n in (*lens, *((None,) if auto else ())):
                    s = g.generate(toks, tokens, draft_len=n or g.max_draft_len,
                                   speculation="on" if n else "auto").stats
                    x = agg.setdefault(f"{name}/{fmt}/" + (f"n={n}" if n else "auto"),
                                       {"committed": 0, "steps": 0, "tokens": 0, "seconds": 0.0,
                                        "drafted": [0] * 7, "accepted": [0] * 7})
                    x["committed"] += s.accepted + s.steps
                    x["steps"] += s.steps
                    x["tokens"] += max(0, s.n_generated - 1)
                    x["seconds"] += s.t_total_s
                    for j, (dr, ac) in enumerate(zip(s.per_position_drafted, s.per_position_accepted, strict=True)):
                        if j < 7:
                            x["drafted"][j] += dr
                            x["accepted"][j] += ac
        print(f"  [{i + 1}/{problems}]", file=sys.stderr, flush=True)
    for g in gens.values():
        g.close()
    rows = {}
    for key, x in agg.items():
        acc = [round(c / d, 3) if d else None for d, c in zip(x["drafted"], x["accepted"], strict=True)]
        rows[key] = {"tau": round(x["committed"] / max(1, x["steps"]), 3),
                     "tok_s": round(x["tokens"] / x["seconds"], 1), "acceptance": acc}
        print(f"{key:14s} tau {rows[key]['tau']:.3f}  {rows[key]['tok_s']:6.1f} tok/s  "
              f"acceptance {rows[key]['acceptance'][:4]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="a drafter GGUF (e.g. the previous one)")
    ap.add_argument("--b", required=True, help="another drafter GGUF (e.g. the new one)")
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results/drafters.json")
    a = ap.parse_args()
    rows = humaneval_tau({"a": a.a, "b": a.b}, a.problems, a.tokens)
    res = {"command": "python3 bench/bench_drafters.py " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "problems": a.problems,
           "tokens": a.tokens, "a": a.a, "b": a.b, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

